"""The ``gla`` contract (gated linear attention, Yang et al. 2024).

Shapes: B batch, T length, H heads (shared by ``q``, ``k``, ``v`` and ``g``), K query/key head dim,
V value head dim, N packed sequences.

For every batch row (or packed sequence) and head, with a state ``S`` of shape ``[K, V]`` that starts
at ``initial_state`` (zeros when absent), token by token:

1. ``S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t``: every key channel ``i`` of the state decays by
   ``exp(g_t[i])``, then the outer product of the key and the value is added;
2. ``o_t = scale * q_t S_t`` (the current token included; ``scale`` defaults to ``K ** -0.5``).

This is the convention of flash-linear-attention's ``chunk_gla``. ``g`` is the log of the decay, so
``g <= 0`` (for instance ``log_sigmoid(x) / 16``); values above 0 are not checked but are outside the
contract (implementations may overflow). Everything is computed in float32; the output has ``q``'s
dtype and the final state ``S_T`` is float32. ``g`` and ``initial_state`` may have any float dtype. Every
array argument is differentiable (the gradient of ``g`` included).

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


def gla(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T H K"],
    v: Float[Array, "B T H V"],
    g: Float[Array, "B T H K"],
    *,
    scale: float | None = None,
    initial_state: Float[Array, "B_or_N H K V"] | None = None,
    output_final_state: bool = False,
    cu_seqlens: Int[Array, "N+1"] | None = None,
    fwd_params: FwdParams | None = None,
    bwd_params: BwdParams | None = None,
) -> tuple[Float[Array, "B T H V"], Float[Array, "B_or_N H K V"] | None]:
    """Canonical signature of ``gla`` (see the module docstring for the semantics)."""
    raise NotImplementedError


def validate(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    *,
    scale: float | None = None,
    initial_state: Any = None,
    output_final_state: bool = False,
    cu_seqlens: Any = None,
    **_: Any,
) -> None:
    """Check a ``gla`` call; raise an error naming the argument, what was expected and what came."""
    dims = check_qkv("gla", q, k, v)
    check_gate("gla", "g", g, dims[:4], "[B, T, H, K]")
    check_state_options(
        "gla",
        dims,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )
