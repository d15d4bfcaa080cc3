"""Chunked linear attention with one log decay per token, head and value channel (``value_gla``): the kernels of
``ejkernel_triton._value_chunk_kernels``, forward and backward. ``recurrent`` with a value gate ``g_v`` (and no key
gate) runs on it, with ``gv = g + g_v``; with a key gate too, on ``keyed_value_gla``: these kernels with the key
side's log decays ``g + g_k`` added (``[B, T, H, K + V]``: both sides' side by side), the chunked ``gla``'s
intra-chunk scores and ``dq``/``dk`` kernels taking that side (see ``ejkernel_triton._value_chunk_kernels``).

Shapes: ``q``, ``k [B, T, H, K]``, ``v [B, T, H, V]``, ``gv [B, T, H, V]`` (log decay, ``<= 0``), states ``[B or
N, H, K, V]``, ``cu_seqlens [N + 1]`` (``B == 1``). Per sequence and head: ``S_t = S_{t-1} diag(exp(gv_t)) +
k_t^T v_t``, ``o_t = scale q_t S_t``: each value channel decays on its own (a scalar-decay recurrence per channel).

Forward: the chunk-local cumulative decays (``ejkernel_triton._chunk_kernels.chunk_gate_cumsum``), the chunk
states (one sequential pass per sequence, head and state tile: the chunked ``gla``'s kernel on the transposed
state, whose decay is on its rows), then the output per chunk and value tile.
Backward (``jax.custom_vjp``, residuals: the inputs): the cumulative decays and chunk states again (float32, at
float32 accuracy), the state's gradient (the reverse pass), each chunk's pair matrices ``A = scale q k^T`` and
``D`` (the decayed ``do v^T``) once, ``dv`` with the decay's gradient from ``A`` (chunk-local: no reverse
cumulative sum over the sequence), then ``dq``/``dk`` per chunk and key tile from ``D``. Memory: the chunk states
and their gradients, ``2 (T / C) H K V`` float32 per batch row, the cumulative decays ``T H V`` float32 and the
pair matrices ``2 T C H`` float32 (with a key gate: ``T H (K + V)`` cumulative decays, and the forward keeps its
``T C H`` float32 scores until the output is made). ptxas for sm_90 at K = V = 128, bfloat16, default plans
(``benchmarks/ptxas_report.py keyed_value_gla``, 2026-12-07): ``chunk_dqk_inter`` spills 852 bytes and
``value_dv`` 100 (at 255 registers; float32 inputs 1476 and 152); not yet timed or tuned on a GPU.

Launch parameters and plans: ``ejkernel_triton._simple_chunk``'s (:class:`ChunkFwdParams`/:class:`ChunkBwdParams`
of ``ejkernel_triton.gla.chunk``); chunks are multiples of the kernels' 16-row blocks. Dots as ``simple_gla``'s.
Importing this module does not import Triton.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.device import cdiv

from ejkernel_triton._simple_chunk import (
    Static,
    candidate_cfgs,
    chunked_vjp,
    default_plan,
    heuristic_cfg,
    make_plan,
    run_chunked,
)
from ejkernel_triton.gla import chunk as gla_chunk
from ejkernel_triton.gla.chunk import (
    _BLOCK_ROWS,
    _DOT,
    _DUMMY_F32,
    ChunkBwdParams,
    ChunkFwdParams,
    Plan,
    _dots,
)

__all__ = ["Plan", "candidate_cfgs", "default_plan", "heuristic_cfg", "keyed_value_gla", "make_plan", "value_gla"]


def _cumulative(plan: Plan, tab: Any, gv: jax.Array) -> jax.Array:
    """``b [R, H, V]`` float32: the decays' cumulative sum from each chunk's start (zeros outside every chunk)."""
    from ejkernel_triton import _chunk_kernels as kern
    from ejkernel_triton import launch

    _, h, dv = gv.shape
    (b,) = launch.launch(
        kern.chunk_gate_cumsum,
        gv,
        tab.cu,
        tab.seq,
        tab.off,
        out_shape=(jax.ShapeDtypeStruct(gv.shape, jnp.float32),),
        grid=(tab.nt, h, cdiv(dv, plan.block_v)),
        num_warps=plan.num_warps,
        num_stages=1,
        zeroed_outputs=tab.zeroed(0),
        name="ejkernel_value_gla_cumsum",
        HV=h,
        GK=dv,
        BT=plan.chunk,
        BK=plan.block_v,
    )
    return b


def _states(plan: Plan, tab: Any, k: jax.Array, v: jax.Array, b: jax.Array, h0: jax.Array | None, *, exact: bool,
            hs_dtype: Any, gc: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """``(h^T [NT, H, V, K] in hs_dtype, final state [N, H, K, V] float32)``; ``exact``: float32 accuracy. The
    transposed state ``S^T <- diag(exp(b_L)) S^T + (v exp(b_L - b))^T k`` is the chunked ``gla``'s key-decayed
    state with keys and values swapped: its kernel runs it. ``gc [R, H, K]``: a key side's cumulative gates too
    (the kernel's column gate: ``S^T <- diag(exp(b_L)) S^T diag(exp(gc_L)) + (v exp(b_L - b))^T (k exp(gc_L -
    gc))``)."""
    swapped = dataclasses.replace(plan, state_k=plan.state_v, state_v=plan.state_k)  # the tile of S^T
    h0t = None if h0 is None else jnp.swapaxes(h0, -1, -2)
    hs, ht = gla_chunk._states(swapped, tab, v, k, b, h0t, hs_dtype, exact, gv=gc, name="ejkernel_value_gla_state_fwd")
    return hs, jnp.swapaxes(ht, -1, -2)


def _split(plan: Plan, tab: Any, g: jax.Array, dk: int, keyed: bool) -> tuple[jax.Array, jax.Array | None]:
    """``(b [R, H, V], a [R, H, K] or None)``: the value side's cumulative gates and, ``keyed``, the key side's,
    from ``g`` (``[R, H, V]``, keyed ``[R, H, K + V]``: the key side's gates first), one launch for both."""
    c = _cumulative(plan, tab, g)
    return (c[..., dk:], c[..., :dk]) if keyed else (c, None)


def _forward_rows(
    s: Static, tab: Any, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, h0: jax.Array | None, *, keyed: bool
) -> tuple[jax.Array, jax.Array]:
    """``(o [R, H, V], final state [N, H, K, V])`` of token rows laid out by the chunk table ``tab`` (``g``: see
    :func:`_split`)."""
    from ejkernel_triton import _value_chunk_kernels as kern
    from ejkernel_triton import launch

    plan = s.fwd
    _, h, dk = q.shape
    dv = v.shape[2]
    b, gc = _split(plan, tab, g, dk, keyed)
    # the chunk states only feed the output's dots: stored as those round them, of float32 accuracy only for a
    # final state that is returned
    operand = jnp.bfloat16 if _DOT[np.dtype(q.dtype).name] == "bf16" else jnp.float32
    hs, ht = _states(plan, tab, k, v, b, h0, exact=s.output_final_state, hs_dtype=operand, gc=gc)
    # with a key gate, the scores are the key-decayed ones of the chunked gla (float32: the output's diagonal
    # blocks take them element-wise, not through a dot that would round them)
    a = None if gc is None else gla_chunk._scores(plan, tab, q, k, gc, h, s.scale, jnp.float32)[0]
    dummy = jnp.asarray(_DUMMY_F32)
    (o,) = launch.launch(
        kern.value_output,
        q,
        k,
        v,
        b,
        hs,
        dummy if gc is None else gc,
        dummy if a is None else a,
        tab.cu,
        tab.seq,
        tab.off,
        float(s.scale),
        out_shape=(jax.ShapeDtypeStruct(v.shape, q.dtype),),
        grid=(tab.nt * cdiv(dv, plan.block_v), h),
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
        zeroed_outputs=tab.zeroed(0),  # tokens outside every sequence give zeros
        name="ejkernel_value_gla_output",
        H=h,
        DK=dk,
        DV=dv,
        BT=plan.chunk,
        BK=plan.block_k,
        BV=plan.block_v,
        BC=_BLOCK_ROWS,
        HAS_GK=keyed,
        **_dots(q.dtype),
    )
    return o, ht


def _backward_rows(
    s: Static,
    tab: Any,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    h0: jax.Array | None,
    do: jax.Array,
    dht: jax.Array | None,
    *,
    keyed: bool,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """``(dq, dk, dv (inputs' dtype), dg (``g``'s shape, :func:`_split`) float32, dh0 [N, H, K, V] float32)``.
    With a key gate (``keyed``) the scores and ``dq``/``dk`` with the key gate's gradient are the chunked
    ``gla``'s kernels' (``ejkernel_triton.gla.chunk._scores``, ``_dqk``), fed the value side's decays."""
    from ejkernel_triton import _chunk_kernels as chunk_kernels
    from ejkernel_triton import _value_chunk_kernels as kern
    from ejkernel_triton import launch

    plan = s.bwd
    _, h, dk = q.shape
    dv = v.shape[2]
    f32 = jnp.float32
    dummy = jnp.asarray(_DUMMY_F32)
    b, gc = _split(plan, tab, g, dk, keyed)
    hs, _ = _states(plan, tab, k, v, b, h0, exact=True, hs_dtype=f32, gc=gc)
    common: dict[str, Any] = {
        "num_warps": plan.num_warps,
        "num_stages": plan.num_stages,
        "H": h,
        "DK": dk,
        "DV": dv,
        "BT": plan.chunk,
        **_dots(q.dtype),
    }
    # the transposed state's gradient, dS^T <- diag(exp(b_L)) dS^T + scale (do exp(b))^T q: the chunked gla's
    # reverse pass with q and do swapped
    dhe, dh0 = launch.launch(
        chunk_kernels.chunk_state_bwd,
        do,
        q,
        b,
        dummy if gc is None else gc,
        dummy if dht is None else jnp.swapaxes(dht, -1, -2),
        tab.cu,
        tab.off,
        float(s.scale),
        out_shape=(
            jax.ShapeDtypeStruct((tab.nt, h, dv, dk), f32),
            jax.ShapeDtypeStruct((tab.n, h, dv, dk), f32),
        ),
        grid=(tab.n * cdiv(dv, plan.state_v) * cdiv(dk, plan.state_k), h),
        name="ejkernel_value_gla_state_bwd",
        HV=h,
        GK=dv,
        BK=plan.state_v,
        BV=plan.state_k,
        HAS_DHT=dht is not None,
        HAS_GV=gc is not None,
        **{**common, "DK": dv, "DV": dk, "num_warps": plan.state_warps, "num_stages": plan.state_stages},
    )
    blocks: dict[str, Any] = {"BK": plan.block_k, "BV": plan.block_v, "BC": _BLOCK_ROWS}
    pairs = jax.ShapeDtypeStruct((tab.nt, h, plan.chunk, plan.chunk), f32)
    # keyed: the key-decayed scores come from the gla's kernels (value_pairs then writes only D, times scale)
    a_, d_ = launch.launch(
        kern.value_pairs,
        q,
        k,
        v,
        b,
        do,
        tab.cu,
        tab.seq,
        tab.off,
        float(s.scale),
        out_shape=(jax.ShapeDtypeStruct((1,), f32) if keyed else pairs, pairs),
        grid=(tab.nt, h),
        zeroed_outputs=(1,),  # D is written block by block, its upper blocks not at all
        name="ejkernel_value_gla_pairs",
        HAS_GK=keyed,
        **blocks,
        **common,
    )
    if gc is not None:
        a_ = gla_chunk._scores(plan, tab, q, k, gc, h, s.scale, f32)[0]
    dv_, dgu, dgw = launch.launch(
        kern.value_dv,
        q,
        k,
        v,
        b,
        dummy if gc is None else gc,
        do,
        hs,
        dhe,
        a_,
        tab.cu,
        tab.seq,
        tab.off,
        float(s.scale),
        out_shape=(
            jax.ShapeDtypeStruct(v.shape, v.dtype),
            jax.ShapeDtypeStruct(v.shape, f32),
            jax.ShapeDtypeStruct(v.shape, f32),
        ),
        grid=(tab.nt * cdiv(dv, plan.block_v), h),
        zeroed_outputs=tab.zeroed(0, 1, 2),  # tokens outside every sequence get no gradient
        name="ejkernel_value_gla_dv",
        HAS_GK=keyed,
        **blocks,
        **common,
    )
    if gc is not None:  # the scores' gradient is scale D (value_pairs)
        dq, dk_, dgk = gla_chunk._dqk(plan, tab, q, k, v, gc, do, hs, dhe, d_, s.scale, gv=b)
        return dq, dk_, dv_, jnp.concatenate([dgk, dgu + dgw], axis=-1), jnp.swapaxes(dh0, -1, -2)
    dq, dk_ = launch.launch(
        kern.value_dqk,
        q,
        k,
        v,
        b,
        do,
        hs,
        dhe,
        d_,
        tab.cu,
        tab.seq,
        tab.off,
        float(s.scale),
        out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype)),
        grid=(tab.nt * cdiv(dk, plan.block_k), h),
        zeroed_outputs=tab.zeroed(0, 1),
        name="ejkernel_value_gla_dqk",
        **blocks,
        **common,
    )
    return dq, dk_, dv_, dgu + dgw, jnp.swapaxes(dh0, -1, -2)


# ------------------------------------------------------------------------------------------------
# The differentiable call.
# ------------------------------------------------------------------------------------------------


_value_chunk = chunked_vjp(
    functools.partial(_forward_rows, keyed=False), functools.partial(_backward_rows, keyed=False)
)
_keyed_chunk = chunked_vjp(functools.partial(_forward_rows, keyed=True), functools.partial(_backward_rows, keyed=True))


def value_gla(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    gv: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    cu_seqlens: jax.Array | None = None,
    fwd_params: ChunkFwdParams | None = None,
    bwd_params: ChunkBwdParams | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Linear attention decaying by ``exp(gv[b, t, h, c])`` per token, head and value channel, by the chunked
    Triton kernels.

    Shapes: ``q``, ``k [B, T, H, K]``, ``v``, ``gv [B, T, H, V]`` (``gv`` any float dtype, taken as float32),
    ``initial_state [B or N, H, K, V]`` (any float dtype), ``cu_seqlens [N + 1]`` (``B == 1``); returns ``(o
    [B, T, H, V] in q's dtype, final state float32 or None)``. Differentiable in ``q``, ``k``, ``v``, ``gv`` and
    ``initial_state``."""
    args = (scale, initial_state, output_final_state, cu_seqlens, fwd_params, bwd_params)
    return run_chunked(_value_chunk, q, k, v, gv, *args)


def keyed_value_gla(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    gates: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    cu_seqlens: jax.Array | None = None,
    fwd_params: ChunkFwdParams | None = None,
    bwd_params: ChunkBwdParams | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Linear attention whose state decays on both sides, ``S_t = diag(exp(a_t)) S_{t-1} diag(exp(b_t)) + k_t^T
    v_t``, ``o_t = scale q_t S_t``, by the chunked Triton kernels: :func:`value_gla`'s with the key side's decays
    (and the chunked ``gla``'s intra-chunk scores and ``dq``/``dk`` kernels).

    Shapes: ``q``, ``k [B, T, H, K]``, ``v [B, T, H, V]``, ``gates [B, T, H, K + V]``: the log decays ``a`` (key
    side, the first ``K`` channels) and ``b`` (value side) side by side, any float dtype (taken as float32); the
    rest as :func:`value_gla`'s. Differentiable in ``q``, ``k``, ``v``, ``gates`` and ``initial_state``."""
    args = (scale, initial_state, output_final_state, cu_seqlens, fwd_params, bwd_params)
    return run_chunked(_keyed_chunk, q, k, v, gates, *args)
