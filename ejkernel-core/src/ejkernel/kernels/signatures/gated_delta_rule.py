"""The ``gated_delta_rule`` contract (the recurrence of Gated DeltaNet).

Shapes: B batch, T length, H heads, K query/key head dim, V value head dim, N packed sequences.

For every batch row (or packed sequence) and head, with a state ``S`` of shape ``[K, V]`` that starts
at ``initial_state`` (zeros when absent), token by token (``a_t = exp(g_t)``):

1. with ``use_qk_l2norm``: ``q_t = q_t / sqrt(|q_t|^2 + 1e-6)``, likewise ``k_t`` (in float32);
2. ``S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``, that is: decay the state, read the
   value it holds for ``k_t``, and move it a fraction ``beta_t`` of the way towards ``v_t``
   (``S = a S; S += beta k (v - S^T k)^T``);
3. ``o_t = scale * S_t^T q_t`` (``scale`` defaults to ``K ** -0.5``).

This is the convention of flash-linear-attention's ``chunk_gated_delta_rule``. ``g`` is the log of the
decay and ``beta`` the writing strength; with ``g <= 0``, ``beta`` in ``[0, 1]`` and unit-norm keys every
step is a contraction and the state stays bounded (none of this is checked: it is data). The gates may
have another float dtype than ``q``, ``k``, ``v`` (float32 gates beside bfloat16 activations are usual).
Everything is computed in float32; the output has ``q``'s dtype and the final state is float32.

With ``cu_seqlens`` (B == 1) the sequences ``[cu_seqlens[n], cu_seqlens[n + 1])`` are packed along T:
each starts from ``initial_state[n]`` (``[N, H, K, V]``) and its final state is ``final_state[n]``. A
sequence of length 0 outputs nothing and its final state is its initial state; tokens outside
``[cu_seqlens[0], cu_seqlens[N])`` give zeros. ``cu_seqlens`` must be non-decreasing within ``[0, T]``:
checked when concrete (``ValueError``); under ``jit`` it is traced and unchecked unless ``EJKERNEL_CHECKS=1``
(then the call fails when it runs), and a violation gives wrong outputs without an error.
"""

from __future__ import annotations

from typing import Any

from jaxtyping import Array, Float, Int

from ejkernel.kernels.params import BwdParams, FwdParams
from ejkernel.kernels.signatures._checks import check_bool, check_float_array
from ejkernel.kernels.signatures._linear_attention import check_gate, check_qkv, check_state_options

OP = "gated_delta_rule"


def gated_delta_rule(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T H K"],
    v: Float[Array, "B T H V"],
    g: Float[Array, "B T H"],
    beta: Float[Array, "B T H"],
    *,
    scale: float | None = None,
    initial_state: Float[Array, "B_or_N H K V"] | None = None,
    output_final_state: bool = False,
    cu_seqlens: Int[Array, "N+1"] | None = None,
    use_qk_l2norm: bool = False,
    fwd_params: FwdParams | None = None,
    bwd_params: BwdParams | None = None,
) -> tuple[Float[Array, "B T H V"], Float[Array, "B_or_N H K V"] | None]:
    """Canonical signature of ``gated_delta_rule`` (see the module docstring for the semantics)."""
    raise NotImplementedError


def validate(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    beta: Any,
    *,
    scale: float | None = None,
    initial_state: Any = None,
    output_final_state: bool = False,
    cu_seqlens: Any = None,
    use_qk_l2norm: bool = False,
    **_: Any,
) -> None:
    """Check a ``gated_delta_rule`` call; raise an error naming the argument, what was expected and what came."""
    dims = check_qkv(OP, q, k, v)
    for name, x in (("g", g), ("beta", beta)):
        check_float_array(OP, name, x, "[B, T, H]")
        check_gate(OP, name, x, dims[:3], "[B, T, H]")
    check_state_options(
        OP,
        dims,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )
    check_bool(OP, "use_qk_l2norm", use_qk_l2norm)
