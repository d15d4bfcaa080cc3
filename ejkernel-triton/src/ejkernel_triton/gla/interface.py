"""Triton ``gla`` for decoding: the fused recurrent kernel (``ejkernel_triton._recurrent_kernels``).

One program per (sequence, value head, block of value channels) keeps its ``[K, block_v]`` tile of the float32
state in registers over the call's tokens: the state is read once and written once. Grouped value heads read
their shared query/key head in the kernel (no repeat). Launch parameters:
:class:`~ejkernel_triton._recurrent.RecurrentParams` (None fields: :func:`heuristic_cfg`'s).

Declined (``supports``): more than 64 tokens per sequence on average (long sequences are the chunked kernels'
job), head dims above 256, dtypes other than float32, bfloat16 and float16.

Gradients: ``jax.custom_vjp`` whose backward is the VJP of the core's reference recurrence
(``ejkernel.testing.reference.gla``): it recomputes the forward token by token in XLA and keeps every step's
state, ``T * (B or N) * HV * K * V`` float32 (see ``ejkernel_triton._recurrent``); there are no backward launch
parameters (:class:`~ejkernel_triton._recurrent.NoBwdParams`).

Importing this module does not import Triton.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.kernels.params import coerce

from ejkernel_triton._recurrent import (
    Dims,
    NoBwdParams,
    RecurrentParams,
    Static,
    candidate_plans,
    default_plan,
    dims_of,
    fused_recurrent,
    make_plan,
    params_of,
    supports_recurrent,
)

__all__ = ["candidate_cfgs", "gla", "heuristic_cfg", "supports"]

OP = "gla"


def heuristic_cfg(inv: Any, stage: str = "fwd") -> RecurrentParams | NoBwdParams:
    if stage != "fwd":
        return NoBwdParams()  # the backward is the reference's VJP: nothing to tune
    return params_of(default_plan(dims_of(inv)))


def candidate_cfgs(inv: Any, stage: str = "fwd") -> list[RecurrentParams] | list[NoBwdParams]:
    if stage != "fwd":
        return [NoBwdParams()]
    return [params_of(p) for p in candidate_plans(dims_of(inv))]


def supports(inv: Any) -> str | None:
    return supports_recurrent(OP, inv, ("g",))


def gla(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    cu_seqlens: jax.Array | None = None,
    fwd_params: RecurrentParams | None = None,
    bwd_params: NoBwdParams | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Gated linear attention (contract: ``ejkernel.modules.operations.gla``) by the fused recurrent kernel.

    Shapes: ``q``, ``k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g [B, T, HV, K]``, ``initial_state
    [B or N, HV, K, V]``, ``cu_seqlens [N + 1]``; returns ``(o [B, T, HV, V] in q's dtype, final state float32
    or None)``."""
    return gated_recurrence(
        q,
        k,
        v,
        g,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        fwd_params=fwd_params,
        bwd_params=bwd_params,
    )


def gated_recurrence(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    g_v: jax.Array | None = None,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    cu_seqlens: jax.Array | None = None,
    fwd_params: RecurrentParams | None = None,
    bwd_params: NoBwdParams | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """:func:`gla`, and with ``g_v [B, T, HV, V]`` also a log decay of the value channels: ``S = diag(exp(g)) S
    diag(exp(g_v)) + k^T v`` (``recurrent``'s value gate). ``g`` may also be ``[B, T, HV]``, one log decay per token
    and head (``lightning_attn``, ``recurrent`` without a key gate: a decode step reads one number, not ``K``)."""
    p = coerce(RecurrentParams, fwd_params) or RecurrentParams()
    coerce(NoBwdParams, bwd_params)  # checked: a wrong class is an error, never ignored
    q, k, v, g = (jnp.asarray(x) for x in (q, k, v, g))
    b, _, _, dk = q.shape
    n = b if cu_seqlens is None else int(cu_seqlens.shape[0]) - 1
    plan = make_plan(Dims(n, int(v.shape[2]), int(dk), int(v.shape[-1])), p)
    s = Static(False, plan, float(dk**-0.5 if scale is None else scale), bool(output_final_state))
    h0 = None if initial_state is None else jnp.asarray(initial_state)
    cu = None if cu_seqlens is None else jnp.asarray(cu_seqlens)
    gv = None if g_v is None else jnp.asarray(g_v)
    out = fused_recurrent(s, q, k, v, g, gv, None, h0, cu)
    return out[0], (out[1] if output_final_state else None)
