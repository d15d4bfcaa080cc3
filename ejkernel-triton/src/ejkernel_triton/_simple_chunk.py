"""Chunked linear attention with one scalar log decay per token and head (``simple_gla``): the kernels of
``ejkernel_triton._simple_chunk_kernels``, forward and backward. ``lightning_attn`` and ``recurrent`` without a key
gate run on it.

Shapes: ``q``, ``k [B, T, H, K]``, ``v [B, T, H, V]``, ``g [B, T, H]`` (log decay, ``<= 0``), states ``[B or N, H,
K, V]``, ``cu_seqlens [N + 1]`` (``B == 1``). Per sequence and head: ``S_t = exp(g_t) S_{t-1} + k_t^T v_t``,
``o_t = scale q_t S_t``.

Forward: two launches (the chunk states, one sequential pass per sequence, head and state tile; then the output
per chunk and value tile). Backward (``jax.custom_vjp``, residuals: the inputs): the chunk states again (float32,
at float32 accuracy), the state's gradient (the reverse pass), ``dv``, then ``dq``/``dk``/``dg`` per chunk and key
tile (``dg`` chunk-local: no reverse cumulative sum over the sequence). Memory: the chunk states and their
gradients, ``2 (T / C) H K V`` float32 per batch row. Cumulative decays are recomputed in every kernel (one
cumulative sum of ``C`` numbers per chunk) rather than stored.

Launch parameters: ``ejkernel_triton.gla.chunk``'s :class:`ChunkFwdParams`/:class:`ChunkBwdParams` (chunk, key
and value tiles of the chunk-parallel kernels, warps, stages; None fields: :func:`default_plan`'s). Dots as the
chunked ``gla``'s: bfloat16 operands for bfloat16 inputs, float32 (three tf32 passes) for float32 and float16
ones. Packed sequences: ``ejkernel_triton.gla.chunk``'s chunk table. Importing this module does not import
Triton.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.device import cdiv, fold_vmap
from ejkernel.kernels.params import coerce

from ejkernel_triton._decode import interpreting
from ejkernel_triton.gla.chunk import (
    _DEFAULT_BLOCK,
    _DEFAULT_CHUNK,
    _DOT,
    _DUMMY_F32,
    _STATE_PROGRAMS,
    ChunkBwdParams,
    ChunkFwdParams,
    Dims,
    Plan,
    _chunk_table,
    _dims_of,
    _dots,
    _params,
    _pow2,
    _rows,
)

__all__ = ["Plan", "candidate_cfgs", "default_plan", "heuristic_cfg", "make_plan", "simple_gla"]


def _state_tile(d: Dims) -> tuple[int, int]:
    """The state passes' tile: ``[64, 64]`` (cut to the padded head dims), ``[64, 32]`` when that gives fewer than
    ``_STATE_PROGRAMS`` programs (each walks all chunks of its sequence)."""
    k, v = min(_DEFAULT_BLOCK, _pow2(d.dk)), min(_DEFAULT_BLOCK, _pow2(d.dv))
    if d.states and d.states * cdiv(d.dk, k) * cdiv(d.dv, v) < _STATE_PROGRAMS:
        v = min(v, 32)
    return k, v


def default_plan(d: Dims, stage: str = "fwd") -> Plan:
    """Chunks of 64, key/value tiles of 64 channels (cut to the padded head dims), 4 warps, 2 stages.

    Timed on an H200 (B4 T4096 H16 K=V=128 bf16, ``lightning_attn``, ``benchmarks/gpucheck/simple_chunk.py``,
    ``benchmarks/results/2026-12-04-h200-simple-chunk.log``): forward 0.267 ms (97 TFLOP/s), forward + backward
    1.39 ms (56; XLA: 2.36 and 6.24 ms). Within 3 %: forward value or key tiles of 128, 3 stages, backward value
    tiles of 128; slower: 8 warps (forward 0.30 ms), chunks of 32 (0.375 ms, 1.89), backward key tiles of 128 or
    tiles of 32 (1.81 to 1.94 ms), backward 1 or 3 stages (1.55, 1.63). ptxas for sm_90 at K = V = 128
    (``benchmarks/ptxas_report.py simple_gla``): no spills for bfloat16 inputs (``simple_dqk``: 255 registers a
    thread); float32 inputs (three tf32 passes a product; not timed) spill 184 bytes in ``simple_output`` and
    ``simple_dv`` and 1712 in ``simple_dqk``."""
    sk, sv = _state_tile(d)
    return Plan(_DEFAULT_CHUNK, min(_DEFAULT_BLOCK, _pow2(d.dk)), min(_DEFAULT_BLOCK, _pow2(d.dv)), 4, 2, sk, sv, 4, 2)


def make_plan(d: Dims, p: ChunkFwdParams | ChunkBwdParams, stage: str = "fwd") -> Plan:
    """``p``'s fields over :func:`default_plan`'s (tiles cut to the padded head dims)."""
    base = default_plan(d, stage)
    return dataclasses.replace(
        base,
        chunk=p.chunk_size or base.chunk,
        block_k=min(p.block_k or base.block_k, _pow2(d.dk)),
        block_v=min(p.block_v or base.block_v, _pow2(d.dv)),
        num_warps=p.num_warps or base.num_warps,
        num_stages=p.num_stages or base.num_stages,
        state_warps=p.state_warps or base.state_warps,
        state_stages=p.state_stages or base.state_stages,
    )


def _candidate_plans(d: Dims, stage: str = "fwd") -> list[Plan]:
    """The default first; in the interpreter one other (chunks of 16), on a GPU chunks of 64 and 32, key and value
    tiles of 64 and 128 channels, 4 or 8 warps; then the default with the state passes at 8 warps, and at 3 stages
    (up to 18 plans)."""
    base = default_plan(d, stage)
    if interpreting():
        return [base, dataclasses.replace(base, chunk=16)]
    out = [base]
    for chunk in (64, 32):
        for bk in (64, 128):
            for bv in (64, 128):
                for warps in (4, 8):
                    plan = dataclasses.replace(
                        base, chunk=chunk, block_k=min(bk, _pow2(d.dk)), block_v=min(bv, _pow2(d.dv)), num_warps=warps
                    )
                    if plan not in out:
                        out.append(plan)
    out.append(dataclasses.replace(base, state_warps=8))
    out.append(dataclasses.replace(base, state_stages=3))
    return out


def heuristic_cfg(inv: Any, stage: str = "fwd") -> ChunkFwdParams | ChunkBwdParams:
    cls = ChunkFwdParams if stage == "fwd" else ChunkBwdParams
    return _params(cls, default_plan(_dims_of(inv), stage))


def candidate_cfgs(inv: Any, stage: str = "fwd") -> list[ChunkFwdParams] | list[ChunkBwdParams]:
    cls = ChunkFwdParams if stage == "fwd" else ChunkBwdParams
    return [_params(cls, p) for p in _candidate_plans(_dims_of(inv), stage)]


# ------------------------------------------------------------------------------------------------
# The launches.
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Static:
    """Everything static about one call (the custom_vjp's non-differentiable argument)."""

    fwd: Plan
    bwd: Plan
    scale: float
    output_final_state: bool


# Dot operands per input dtype: bfloat16 ones for bfloat16 inputs; float32 for float16 ones as for float32 (a
# float16 operand made of a state or gradients could overflow past 65504).


def _states(plan: Plan, tab: Any, k: jax.Array, v: jax.Array, g: jax.Array, h0: jax.Array | None, *, exact: bool,
            hs_dtype: Any) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """``(h [NT, H, K, V] in hs_dtype, final state [N, H, K, V] float32)``; ``exact``: float32 accuracy."""
    from ejkernel_triton import _simple_chunk_kernels as kern
    from ejkernel_triton import launch

    _, h, dk = k.shape
    dv = v.shape[2]
    hs, ht = launch.launch(
        kern.simple_state_fwd,
        k,
        v,
        g,
        jnp.asarray(_DUMMY_F32) if h0 is None else h0,
        tab.cu,
        tab.off,
        out_shape=(
            jax.ShapeDtypeStruct((tab.nt, h, dk, dv), hs_dtype),
            jax.ShapeDtypeStruct((tab.n, h, dk, dv), jnp.float32),
        ),
        grid=(tab.n * cdiv(dk, plan.state_k) * cdiv(dv, plan.state_v), h),
        num_warps=plan.state_warps,
        num_stages=plan.state_stages,
        name="ejkernel_simple_gla_state_fwd",
        H=h,
        DK=dk,
        DV=dv,
        BT=plan.chunk,
        BK=plan.state_k,
        BV=plan.state_v,
        HAS_H0=h0 is not None,
        SPLIT=exact,
        **_dots(k.dtype),
    )
    return hs, ht


def _forward_rows(
    s: Static, tab: Any, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, h0: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """``(o [R, H, V], final state [N, H, K, V])`` of token rows laid out by the chunk table ``tab``."""
    from ejkernel_triton import _simple_chunk_kernels as kern
    from ejkernel_triton import launch

    plan = s.fwd
    _, h, dk = q.shape
    dv = v.shape[2]
    # The chunk states only feed the output's dots: stored as those round them, and of float32 accuracy (one more
    # product per chunk) only for a final state that is returned.
    operand = jnp.bfloat16 if _DOT[np.dtype(q.dtype).name] == "bf16" else jnp.float32
    hs, ht = _states(plan, tab, k, v, g, h0, exact=s.output_final_state, hs_dtype=operand)
    (o,) = launch.launch(
        kern.simple_output,
        q,
        k,
        v,
        g,
        hs,
        tab.cu,
        tab.seq,
        tab.off,
        float(s.scale),
        out_shape=(jax.ShapeDtypeStruct(v.shape, q.dtype),),
        grid=(tab.nt * cdiv(dv, plan.block_v), h),
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
        zeroed_outputs=tab.zeroed(0),  # tokens outside every sequence give zeros
        name="ejkernel_simple_gla_output",
        H=h,
        DK=dk,
        DV=dv,
        BT=plan.chunk,
        BK=plan.block_k,
        BV=plan.block_v,
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
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """``(dq, dk, dv (inputs' dtype), dg [R, H] float32, dh0 [N, H, K, V] float32)``."""
    from ejkernel_triton import _simple_chunk_kernels as kern
    from ejkernel_triton import launch

    plan = s.bwd
    r, h, dk = q.shape
    dv = v.shape[2]
    f32 = jnp.float32
    common: dict[str, Any] = {
        "num_warps": plan.num_warps,
        "num_stages": plan.num_stages,
        "H": h,
        "DK": dk,
        "DV": dv,
        "BT": plan.chunk,
        **_dots(q.dtype),
    }
    if plan.paired_states:  # the two state walks in one launch (ejkernel_triton.gla.chunk._state_pair says why)
        hs, _, dhe, dh0 = launch.launch(
            kern.simple_state_pair,
            k,
            v,
            q,
            do,
            g,
            jnp.asarray(_DUMMY_F32) if h0 is None else h0,
            jnp.asarray(_DUMMY_F32) if dht is None else dht,
            tab.cu,
            tab.off,
            float(s.scale),
            out_shape=(
                jax.ShapeDtypeStruct((tab.nt, h, dk, dv), f32),
                jax.ShapeDtypeStruct((tab.n, h, dk, dv), f32),
                jax.ShapeDtypeStruct((tab.nt, h, dk, dv), f32),
                jax.ShapeDtypeStruct((tab.n, h, dk, dv), f32),
            ),
            grid=(2 * tab.n * cdiv(dk, plan.state_k) * cdiv(dv, plan.state_v), h),
            name="ejkernel_simple_gla_state_pair",
            BK=plan.state_k,
            BV=plan.state_v,
            HAS_H0=h0 is not None,
            HAS_DHT=dht is not None,
            **{**common, "num_warps": plan.state_warps, "num_stages": plan.state_stages},
        )
    else:
        hs, _ = _states(plan, tab, k, v, g, h0, exact=True, hs_dtype=f32)
        dhe, dh0 = launch.launch(
            kern.simple_state_bwd,
            q,
            do,
            g,
            jnp.asarray(_DUMMY_F32) if dht is None else dht,
            tab.cu,
            tab.off,
            float(s.scale),
            out_shape=(
                jax.ShapeDtypeStruct((tab.nt, h, dk, dv), f32),
                jax.ShapeDtypeStruct((tab.n, h, dk, dv), f32),
            ),
            grid=(tab.n * cdiv(dk, plan.state_k) * cdiv(dv, plan.state_v), h),
            name="ejkernel_simple_gla_state_bwd",
            BK=plan.state_k,
            BV=plan.state_v,
            HAS_DHT=dht is not None,
            **{**common, "num_warps": plan.state_warps, "num_stages": plan.state_stages},
        )
    (dv_,) = launch.launch(
        kern.simple_dv,
        q,
        k,
        g,
        do,
        dhe,
        tab.cu,
        tab.seq,
        tab.off,
        float(s.scale),
        out_shape=(jax.ShapeDtypeStruct(v.shape, v.dtype),),
        grid=(tab.nt * cdiv(dv, plan.block_v), h),
        zeroed_outputs=tab.zeroed(0),
        name="ejkernel_simple_gla_dv",
        BK=plan.block_k,
        BV=plan.block_v,
        **common,
    )
    nk = cdiv(dk, plan.block_k)
    dq, dk_, dg = launch.launch(
        kern.simple_dqk,
        q,
        k,
        v,
        g,
        do,
        hs,
        dhe,
        tab.cu,
        tab.seq,
        tab.off,
        float(s.scale),
        out_shape=(
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct((r, h, nk), f32),
        ),
        grid=(tab.nt * nk, h),
        zeroed_outputs=tab.zeroed(0, 1, 2),  # tokens outside every sequence get no gradient
        name="ejkernel_simple_gla_dqk",
        BK=plan.block_k,
        BV=plan.block_v,
        **common,
    )
    return dq, dk_, dv_, dg.sum(axis=-1), dh0


# ------------------------------------------------------------------------------------------------
# The differentiable call.
# ------------------------------------------------------------------------------------------------


def chunked_vjp(forward_rows: Any, backward_rows: Any) -> Any:
    """The differentiable call ``(s, q, k, v, g, h0, cu) -> (o, final state)`` of a chunked kernel family, from its
    passes over token rows laid out by a chunk table: ``forward_rows(s, tab, q, k, v, g, h0) -> (o, final)`` and
    ``backward_rows(s, tab, q, k, v, g, h0, do, dht) -> (dq, dk, dv, dg, dh0)`` (``q`` ``[R, H, K]``, ``g`` any
    trailing dims). Dense calls fold ``vmap`` into the batch, packed ones (``cu``) run once per element; residuals:
    the inputs; ``g`` and ``h0`` float32, ``cu`` gets no gradient."""

    def forward_dense(s: Static, has_h0: bool, q, k, v, g, h0):  # noqa: ANN001, ANN202
        b, t = q.shape[:2]
        tab = _chunk_table(b, t, s.fwd.chunk, None)
        o, ht = forward_rows(s, tab, _rows(q), _rows(k), _rows(v), _rows(g), h0 if has_h0 else None)
        return o.reshape(v.shape), ht

    def backward_dense(s: Static, has_h0: bool, has_dht: bool, q, k, v, g, h0, do, dht):  # noqa: ANN001, ANN202
        b, t = q.shape[:2]
        tab = _chunk_table(b, t, s.bwd.chunk, None)
        dq, dk, dv, dg, dh0 = backward_rows(
            s, tab, _rows(q), _rows(k), _rows(v), _rows(g), h0 if has_h0 else None, _rows(do), dht if has_dht else None
        )
        return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), dg.reshape(g.shape), dh0

    def forward(s: Static, q, k, v, g, h0, cu):  # noqa: ANN001, ANN202
        if cu is None:
            h0_ = jnp.asarray(_DUMMY_F32) if h0 is None else h0
            run = fold_vmap(
                functools.partial(forward_dense, s, h0 is not None), (0, 0, 0, 0, 0 if h0 is not None else None), 0
            )
            return run(q, k, v, g, h0_)
        tab = _chunk_table(1, q.shape[1], s.fwd.chunk, cu)
        o, ht = forward_rows(s, tab, q[0], k[0], v[0], g[0], h0)
        return o[None], ht

    def backward(s: Static, res: tuple[Any, ...], cotangents: tuple[jax.Array, ...]) -> tuple[Any, ...]:
        q, k, v, g, h0, cu = res
        do = cotangents[0].astype(q.dtype)
        dht = cotangents[1].astype(jnp.float32) if s.output_final_state else None
        if cu is None:
            h0_ = jnp.asarray(_DUMMY_F32) if h0 is None else h0
            dht_ = jnp.asarray(_DUMMY_F32) if dht is None else dht
            run = fold_vmap(
                functools.partial(backward_dense, s, h0 is not None, dht is not None),
                (0, 0, 0, 0, 0 if h0 is not None else None, 0, 0 if dht is not None else None),
                0,
            )
            dq, dk, dv, dg, dh0 = run(q, k, v, g, h0_, do, dht_)
        else:
            tab = _chunk_table(1, q.shape[1], s.bwd.chunk, cu)
            dq, dk, dv, dg, dh0 = backward_rows(s, tab, q[0], k[0], v[0], g[0], h0, do[0], dht)
            dq, dk, dv, dg = dq[None], dk[None], dv[None], dg[None]
        return dq, dk, dv, dg, None if h0 is None else dh0, None

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def call(s: Static, q, k, v, g, h0, cu):  # noqa: ANN001, ANN202
        return forward(s, q, k, v, g, h0, cu)

    call.defvjp(lambda s, *args: (forward(s, *args), args), backward)
    return call


def run_chunked(
    run: Any,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    scale: float | None,
    initial_state: jax.Array | None,
    output_final_state: bool,
    cu_seqlens: jax.Array | None,
    fwd_params: ChunkFwdParams | None,
    bwd_params: ChunkBwdParams | None,
) -> tuple[jax.Array, jax.Array | None]:
    """``run(s, q, k, v, g, h0, cu)`` (a :func:`chunked_vjp` call) with its plans made from the parameters: the
    public wrappers' shared argument preparation (``g`` taken as float32; the final state dropped unless asked)."""
    fp = coerce(ChunkFwdParams, fwd_params) or ChunkFwdParams()
    bp = coerce(ChunkBwdParams, bwd_params) or ChunkBwdParams()
    q, k, v = (jnp.asarray(x) for x in (q, k, v))
    h0 = None if initial_state is None else jnp.asarray(initial_state).astype(jnp.float32)
    cu = None if cu_seqlens is None else jnp.asarray(cu_seqlens)
    d = _dims_of({"q": q, "v": v, "cu_seqlens": cu_seqlens})
    s = Static(
        make_plan(d, fp, "fwd"),
        make_plan(d, bp, "bwd"),
        float(d.dk**-0.5 if scale is None else scale),
        bool(output_final_state),
    )
    o, final = run(s, q, k, v, jnp.asarray(g).astype(jnp.float32), h0, cu)
    return o, (final if output_final_state else None)


_simple_chunk = chunked_vjp(_forward_rows, _backward_rows)


def simple_gla(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    cu_seqlens: jax.Array | None = None,
    fwd_params: ChunkFwdParams | None = None,
    bwd_params: ChunkBwdParams | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Linear attention decaying by ``exp(g[b, t, h])`` per token and head, by the chunked Triton kernels.

    Shapes: ``q``, ``k [B, T, H, K]``, ``v [B, T, H, V]``, ``g [B, T, H]`` (any float dtype, taken as float32),
    ``initial_state [B or N, H, K, V]`` (any float dtype), ``cu_seqlens [N + 1]`` (``B == 1``); returns ``(o
    [B, T, H, V] in q's dtype, final state float32 or None)``. Differentiable in ``q``, ``k``, ``v``, ``g`` and
    ``initial_state``."""
    args = (scale, initial_state, output_final_state, cu_seqlens, fwd_params, bwd_params)
    return run_chunked(_simple_chunk, q, k, v, g, *args)
