"""The ``recurrent`` contract: the general gated linear-attention recurrence.

Shapes: B batch, T length, H heads (shared by every array), K query/key head dim, V value head dim,
N packed sequences.

For every batch row (or packed sequence) and head, with a state ``S`` of shape ``[K, V]`` that starts
at ``initial_state`` (zeros when absent), token by token:

1. ``S_t = exp(g_t) * diag(exp(g_k,t)) S_{t-1} diag(exp(g_v,t)) + k_t^T v_t``: state entry ``(i, j)``
   decays by ``exp(g_t + g_k,t[i] + g_v,t[j])``; an absent gate counts as 0 (no decay), so with no gate
   at all this is plain causal linear attention;
2. ``o_t = scale * q_t S_t`` (the current token included; ``scale`` defaults to ``K ** -0.5``).

With ``reverse`` the tokens are visited from the last to the first (``t = T-1, ..., 0``, or from
``cu_seqlens[n+1] - 1`` down to ``cu_seqlens[n]`` within each packed sequence): ``S_{t+1}`` takes the
place of ``S_{t-1}``, so ``o_t`` sums over ``s >= t``, and the final state is the state after the first
token. This is the convention of flash-linear-attention's ``fused_recurrent`` (``g``, ``gk``, ``gv``).

The gates are logs of decays, so ``<= 0`` (values above 0 are not checked but are outside the contract:
implementations may overflow). Everything is computed in float32; the output has ``q``'s dtype and the
final state is float32. Gates and ``initial_state`` may have any float dtype; every array argument is
differentiable.

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
from ejkernel.kernels.signatures._checks import check_bool
from ejkernel.kernels.signatures._linear_attention import check_gate, check_qkv, check_state_options


def recurrent(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T H K"],
    v: Float[Array, "B T H V"],
    g: Float[Array, "B T H"] | None = None,
    g_k: Float[Array, "B T H K"] | None = None,
    g_v: Float[Array, "B T H V"] | None = None,
    *,
    scale: float | None = None,
    initial_state: Float[Array, "B_or_N H K V"] | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    cu_seqlens: Int[Array, "N+1"] | None = None,
    fwd_params: FwdParams | None = None,
    bwd_params: BwdParams | None = None,
) -> tuple[Float[Array, "B T H V"], Float[Array, "B_or_N H K V"] | None]:
    """Canonical signature of ``recurrent`` (see the module docstring for the semantics)."""
    raise NotImplementedError


def validate(
    q: Any,
    k: Any,
    v: Any,
    g: Any = None,
    g_k: Any = None,
    g_v: Any = None,
    *,
    scale: float | None = None,
    initial_state: Any = None,
    output_final_state: bool = False,
    reverse: bool = False,
    cu_seqlens: Any = None,
    **_: Any,
) -> None:
    """Check a ``recurrent`` call; raise an error naming the argument, what was expected and what came."""
    dims = check_qkv("recurrent", q, k, v)
    b, t, h, dk, dv = dims
    if g is not None:
        check_gate("recurrent", "g", g, (b, t, h), "[B, T, H]")
    if g_k is not None:
        check_gate("recurrent", "g_k", g_k, (b, t, h, dk), "[B, T, H, K]")
    if g_v is not None:
        check_gate("recurrent", "g_v", g_v, (b, t, h, dv), "[B, T, H, V]")
    check_state_options(
        "recurrent",
        dims,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )
    check_bool("recurrent", "reverse", reverse)
