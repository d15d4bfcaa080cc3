"""The ``lightning_attn`` contract (linear attention with a fixed decay per head, as in Lightning Attention).

Shapes: B batch, T length, H heads (shared by ``q``, ``k``, ``v``), K query/key head dim, V value head
dim, N packed sequences.

For every batch row (or packed sequence) and head ``h``, with a state ``S`` of shape ``[K, V]`` that
starts at ``initial_state`` (zeros when absent), token by token:

1. ``S_t = exp(-slope[h]) S_{t-1} + k_t^T v_t``: the whole state decays by the same factor each step;
2. ``o_t = scale * q_t S_t`` (the current token included; ``scale`` defaults to ``K ** -0.5``).

Unrolled: ``o_t = scale * sum_{s <= t} exp(-slope[h] (t - s)) (q_t . k_s) v_s`` plus the decayed initial
state. ``slope >= 0`` (0: no decay, plain causal linear attention); negative slopes are not checked but
are outside the contract. Lightning Attention / MiniMax build the slopes ALiBi-style per layer
(flash-linear-attention's ``chunk_lightning_attn`` uses ``slope[h] = 8 h / H * (1 - layer / layers)``);
this op takes them as an array and is differentiable in it. Everything is computed in float32; the
output has ``q``'s dtype and the final state is float32. ``slope`` and ``initial_state`` may have any
float dtype.

With ``cu_seqlens`` (B == 1) the sequences ``[cu_seqlens[n], cu_seqlens[n + 1])`` are packed along T:
each starts from ``initial_state[n]`` (``[N, H, K, V]``) and its final state is ``final_state[n]``. A
sequence of length 0 outputs nothing and its final state is its initial state; tokens outside
``[cu_seqlens[0], cu_seqlens[N])`` give zeros. ``cu_seqlens`` must be non-decreasing within ``[0, T]``:
checked when concrete (``ValueError``); under ``jit`` it is traced and unchecked unless ``EJKERNEL_CHECKS=1``
(then the call fails when it runs), and a violation gives wrong outputs without an error.

Returns ``(o, final_state)``: ``o`` ``[B, T, H, V]``, ``final_state`` ``[B or N, H, K, V]`` when
``output_final_state`` else ``None``.
"""

from __future__ import annotations

from typing import Any

from jaxtyping import Array, Float, Int

from ejkernel.kernels.params import BwdParams, FwdParams
from ejkernel.kernels.signatures._linear_attention import check_gate, check_qkv, check_state_options


def lightning_attn(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T H K"],
    v: Float[Array, "B T H V"],
    slope: Float[Array, "H"],
    *,
    scale: float | None = None,
    initial_state: Float[Array, "B_or_N H K V"] | None = None,
    output_final_state: bool = False,
    cu_seqlens: Int[Array, "N+1"] | None = None,
    fwd_params: FwdParams | None = None,
    bwd_params: BwdParams | None = None,
) -> tuple[Float[Array, "B T H V"], Float[Array, "B_or_N H K V"] | None]:
    """Canonical signature of ``lightning_attn`` (see the module docstring for the semantics)."""
    raise NotImplementedError


def validate(
    q: Any,
    k: Any,
    v: Any,
    slope: Any,
    *,
    scale: float | None = None,
    initial_state: Any = None,
    output_final_state: bool = False,
    cu_seqlens: Any = None,
    **_: Any,
) -> None:
    """Check a ``lightning_attn`` call; raise an error naming the argument, what was expected and what came."""
    dims = check_qkv("lightning_attn", q, k, v)
    check_gate("lightning_attn", "slope", slope, (dims[2],), "[H]")
    check_state_options(
        "lightning_attn",
        dims,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )
