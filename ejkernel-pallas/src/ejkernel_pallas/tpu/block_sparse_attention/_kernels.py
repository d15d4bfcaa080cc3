"""Mosaic TPU block-sparse attention kernels: forward, dK/dV and dQ, one ``pallas_call`` each.

Layout (as ``flash_attention``): heads lead, ``q [B, H, Tp, D]``, ``k/v [B, K, Sp, D|Dv]``, the lengths padded
to whole tiles (padded keys are masked, padded query rows sliced off by the caller). Query head ``h``
reads kv head ``h // G``, ``G = H // K``, through the index maps.

Sparse grids. The last grid axis walks a list instead of the tiles: step ``n`` of query tile ``i``
processes the ``n``-th key tile that the schedule (``_schedule``) admits for ``i``, read by the index
maps from the scalar-prefetched list. Steps past the list's count do nothing, and their index maps
repeat the last admitted tile, so that the pipeline fetches nothing either: a masked-out tile costs
neither a DMA nor compute (only an empty grid step when the grid is longer than the list).

Token masks. A *full* tile pair runs without one. A *partial* pair builds a ``[bq, bk]`` mask from iotas
(padded keys, causal), the segment ids and, when a tile spans several mask blocks, the pair's
``[rq, rk]`` mask blocks (a small VMEM block per pair), expanded to tokens by selects over the blocks'
static row and column ranges (``_expand``).

Grids: forward and dQ ``(B, H, nqt, key steps)``; dK/dV ``(B, K, nkt, G, query steps)``, which adds the ``G``
query heads of a kv head into one float32 scratch, so that dK/dV come out per kv head. The reduction
axes are last and ``arbitrary``, the others ``parallel``. Running statistics live in VMEM scratch
replicated over the 128 lanes (the TPU's layout for a per-row value).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ejkernel_pallas.tpu.block_sparse_attention._schedule import Schedule

F32 = jnp.float32
I32 = jnp.int32
LANES = 128


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Static description of one pass: lengths, tiles, options, lanes and grid lengths."""

    t: int
    s: int
    bq: int
    bk: int
    nqt: int
    nkt: int
    group: int  # G: query heads per kv head
    scale: float
    causal: bool
    soft_cap: float | None
    has_segments: bool
    lanes: tuple[int, int]  # (Lb, Lh) of the lists
    mask_lanes: tuple[int, int] | None  # (Mb, Mh) of the per-pair mask blocks; None when the kernels take none
    q_block: int  # the mask's granularity (tiles are multiples of it)
    kv_block: int
    kv_steps: int  # grid length of the forward and dQ kernels (the longest key list)
    q_steps: int  # grid length of the dK/dV kernel (the longest query list)

    @property
    def offset(self) -> int:
        return self.s - self.t  # bottom-right alignment: query i sits at key position i + S - T

    def list_lane(self, b: Any, h: Any) -> Any:
        lb, lh = self.lanes
        return (b if lb > 1 else 0) * lh + (h if lh > 1 else 0)

    def mask_lane(self, b: Any, h: Any) -> Any:
        assert self.mask_lanes is not None
        mb, mh = self.mask_lanes
        return (b if mb > 1 else 0) * mh + (h if mh > 1 else 0)

    def scores(self, q: Any, k: Any) -> tuple[Any, Any]:
        """``(s, capped)`` of one tile: scaled, soft-capped scores in float32 and ``tanh(raw / cap)`` (or None)."""
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=F32) * self.scale
        capped = None
        if self.soft_cap is not None:
            capped = jnp.tanh(s / self.soft_cap)
            s = self.soft_cap * capped
        return s, capped

    def token_mask(self, iq: Any, jk: Any, named: dict[str, Any]) -> Any:
        """``[bq, bk]`` bool: which token pairs of query tile ``iq`` and key tile ``jk`` are attended (partial pairs)."""
        shape = (self.bq, self.bk)
        cols = jk * self.bk + lax.broadcasted_iota(I32, shape, 1)
        mask = cols < self.s
        if self.causal:
            rows = iq * self.bq + lax.broadcasted_iota(I32, shape, 0)
            mask &= cols <= rows + self.offset
        if named["qseg"] is not None:
            mask &= named["qseg"][...] == named["kseg"][...]  # [bq, 1] == [1, bk]
        if named["sub"] is not None:
            mask &= _expand(self, named["sub"][...])
        return mask


def _vregs(rows: int, cols: int) -> int:
    return -(-rows // 8) * -(-cols // LANES)


def _expand(geo: Geometry, sub: Any) -> Any:
    """``[rq, rk]`` mask blocks (int32) -> the ``[bq, bk]`` token mask they cover.

    Block ``(a, b)`` covers rows ``[a * q_block, (a + 1) * q_block)`` and columns ``[b * kv_block, ...)``
    of the tile. One axis is expanded, then the other: blocks in increasing order, each overwriting
    the tokens from its first one on (one compare and one select per block). A block's row or column
    is picked by a masked sum, and only float32 values are broadcast (no unaligned slice, no gather,
    no broadcast of a boolean vector). The order is the one with fewer vector-register operations;
    the costly loop is the second, over whole ``[bq, bk]`` tiles.
    """
    rq, rk = geo.bq // geo.q_block, geo.bk // geo.kv_block
    full = (geo.bq, geo.bk)

    def pick(y: Any, axis: int, index: int) -> Any:
        """Row (``axis=0``) or column ``index`` of ``y``, its dims kept."""
        if y.shape[axis] == 1:
            return y
        iota = lax.broadcasted_iota(I32, y.shape, axis)
        return jnp.sum(jnp.where(iota == index, y, 0.0), axis=axis, keepdims=True)

    def spread(y: Any, shape: tuple[int, int], axis: int, count: int, width: int) -> Any:
        """``shape``-sized: along ``axis``, token ``i`` takes entry ``i // width`` of ``y`` (``count`` entries)."""
        pos = lax.broadcasted_iota(I32, shape, axis)
        out = jnp.broadcast_to(pick(y, axis, 0), shape)
        for index in range(1, count):
            out = jnp.where(pos >= index * width, pick(y, axis, index), out)
        return out

    x = sub.astype(F32)
    cols_first = rk * (_vregs(rq, rk) + _vregs(rq, geo.bk)) + rq * (_vregs(rq, geo.bk) + _vregs(*full))
    rows_first = rq * (_vregs(rq, rk) + _vregs(geo.bq, rk)) + rk * (_vregs(geo.bq, rk) + _vregs(*full))
    if cols_first <= rows_first:
        wide = spread(x, (rq, geo.bk), 1, rk, geo.kv_block)  # [rq, bk]: the blocks' rows at token columns
        out = spread(wide, full, 0, rq, geo.q_block)
    else:
        tall = spread(x, (geo.bq, rk), 0, rq, geo.q_block)  # [bq, rk]: the blocks' columns at token rows
        out = spread(tall, full, 1, rk, geo.kv_block)
    return out > 0.5


def _named(geo: Geometry, refs: tuple[Any, ...]) -> tuple[dict[str, Any], tuple[Any, ...]]:
    """Name the optional input refs (mask blocks, segment ids) that follow the fixed inputs."""
    rest = list(refs)
    named: dict[str, Any] = {"sub": None, "qseg": None, "kseg": None}
    if geo.mask_lanes is not None:
        named["sub"] = rest.pop(0)
    if geo.has_segments:
        named["qseg"], named["kseg"] = rest.pop(0), rest.pop(0)
    return named, tuple(rest)


def _entry(lst: Any, row: Any, width: int, n: Any) -> tuple[Any, Any]:
    """``(tile, partial)`` of list entry ``n`` of ``row``."""
    e = lst[row * width + n]
    return lax.shift_right_logical(e, 1), e & 1


def _listed(lst: Any, count: Any, row: Any, width: int, n: Any) -> Any:
    """The tile of step ``n`` for an index map: entry ``n``, or the last admitted one past the count (no fetch)."""
    last = jnp.maximum(count[row] - 1, 0)
    return lax.shift_right_logical(lst[row * width + jnp.minimum(n, last)], 1)


def _extra_specs(
    geo: Geometry, head: Callable[..., Any], q_tile: Callable[..., Any], k_tile: Callable[..., Any]
) -> list[Any]:
    """Block specs of the optional inputs, given functions of the index map's arguments: ``(b, h)``, query tile,
    key tile."""
    specs = []
    if geo.mask_lanes is not None:
        rq, rk = geo.bq // geo.q_block, geo.bk // geo.kv_block
        specs.append(
            pl.BlockSpec(
                (None, None, None, rq, rk), lambda *a: (geo.mask_lane(*head(*a)), q_tile(*a), k_tile(*a), 0, 0)
            )
        )
    if geo.has_segments:
        specs.append(pl.BlockSpec((None, geo.bq, 1), lambda *a: (a[0], q_tile(*a), 0)))
        specs.append(pl.BlockSpec((None, 1, geo.bk), lambda *a: (a[0], 0, k_tile(*a))))
    return specs


def _compiler_params(interpret: Any, semantics: tuple[Any, ...]) -> Any:
    if interpret:
        # JAX's TPU interpreter does not extend dimension_semantics by the grid axes that vmap prepends
        # (Mosaic's lowering does), so interpreted kernels leave them unset: every axis sequential.
        return pltpu.CompilerParams()
    return pltpu.CompilerParams(dimension_semantics=semantics)


# ----------------------------------------------------------------------------------------- forward


def _fwd_kernel(geo: Geometry, kv_list: Any, kv_count: Any, q_ref: Any, k_ref: Any, v_ref: Any, *refs: Any) -> None:
    named, (o_ref, lse_ref, m_sc, l_sc, acc_sc) = _named(geo, refs)
    b, h, iq, n = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
    row = geo.list_lane(b, h) * geo.nqt + iq
    jk, partial = _entry(kv_list, row, geo.nkt, n)
    live = n < kv_count[row]

    @pl.when(n == 0)
    def _init() -> None:
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, F32)
        l_sc[...] = jnp.zeros(l_sc.shape, F32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, F32)

    def step(masked: bool) -> None:
        s, _ = geo.scores(q_ref[...], k_ref[...])
        m_prev = m_sc[:, :1]
        if masked:
            mask = geo.token_mask(iq, jk, named)
            s = jnp.where(mask, s, -jnp.inf)
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row with nothing admitted yet stays at 0
            p = jnp.where(mask, jnp.exp(s - m_safe), 0.0)
        else:  # every score is admitted (and finite)
            m_new = m_safe = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            p = jnp.exp(s - m_safe)
        alpha = jnp.exp(m_prev - m_safe)
        l_sc[...] = jnp.broadcast_to(alpha * l_sc[:, :1] + jnp.sum(p, axis=1, keepdims=True), l_sc.shape)
        v = v_ref[...]
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=F32)
        acc_sc[...] = alpha * acc_sc[...] + pv
        m_sc[...] = jnp.broadcast_to(m_new, m_sc.shape)

    pl.when(live & (partial == 1))(functools.partial(step, True))
    pl.when(live & (partial == 0))(functools.partial(step, False))

    @pl.when(n == geo.kv_steps - 1)
    def _finish() -> None:
        l = l_sc[:, :1]
        has = l > 0
        l_safe = jnp.where(has, l, 1.0)
        o_ref[...] = (acc_sc[...] / l_safe).astype(o_ref.dtype)  # rows without an admitted key: acc = 0
        lse_ref[...] = jnp.where(has, m_sc[:, :1] + jnp.log(l_safe), -jnp.inf)


def _by_query_tile(geo: Geometry) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    """``(head, q_tile, k_tile)`` of the index maps of a ``(B, H, nqt, key steps)`` grid."""

    def head(b: Any, h: Any, *_: Any) -> Any:
        return b, h

    def q_tile(b: Any, h: Any, i: Any, *_: Any) -> Any:
        return i

    def k_tile(b: Any, h: Any, i: Any, n: Any, lst: Any, cnt: Any) -> Any:
        return _listed(lst, cnt, geo.list_lane(b, h) * geo.nqt + i, geo.nkt, n)

    return head, q_tile, k_tile


def forward(geo: Geometry, sched: Schedule, q: Any, k: Any, v: Any, extras: list[Any], interpret: Any) -> Any:
    """``(o [B, H, Tp, Dv], lse [B, H, Tp, 1] float32)`` of padded, head-leading inputs."""
    b, h, tp, d = q.shape
    dv = v.shape[3]
    head, q_tile, k_tile = _by_query_tile(geo)

    def kv_spec(width: int) -> Any:
        return pl.BlockSpec((None, None, geo.bk, width), lambda *a: (a[0], a[1] // geo.group, k_tile(*a), 0))

    def row_spec(width: int) -> Any:
        return pl.BlockSpec((None, None, geo.bq, width), lambda bi, hi, i, *_: (bi, hi, i, 0))

    return pl.pallas_call(
        functools.partial(_fwd_kernel, geo),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, h, geo.nqt, geo.kv_steps),
            in_specs=[row_spec(d), kv_spec(d), kv_spec(dv), *_extra_specs(geo, head, q_tile, k_tile)],
            out_specs=[row_spec(dv), row_spec(1)],
            scratch_shapes=[
                pltpu.VMEM((geo.bq, LANES), F32),
                pltpu.VMEM((geo.bq, LANES), F32),
                pltpu.VMEM((geo.bq, dv), F32),
            ],
        ),
        out_shape=[jax.ShapeDtypeStruct((b, h, tp, dv), q.dtype), jax.ShapeDtypeStruct((b, h, tp, 1), F32)],
        compiler_params=_compiler_params(interpret, ("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="ejkernel_block_sparse_attention_fwd",
    )(sched.kv_list, sched.kv_count, q, k, v, *extras)


# ---------------------------------------------------------------------------------------- backward


def _probabilities_and_dscores(
    geo: Geometry, masked: bool, iq: Any, jk: Any, q: Any, k: Any, v: Any, do: Any, lse: Any, delta: Any, named: Any
) -> tuple[Any, Any]:
    """``(p, ds)`` of one tile: ``p = exp(s - lse)`` and the gradient w.r.t. the raw (pre-cap) scores
    ``ds = p * (dO v^T - delta)`` times the soft cap's derivative."""
    s, capped = geo.scores(q, k)
    # Rows without an admitted key (lse = -inf) get p = 0 from the mask; padded rows have dO = 0.
    p = jnp.exp(s - jnp.where(lse == -jnp.inf, 0.0, lse))
    if masked:
        p = jnp.where(geo.token_mask(iq, jk, named), p, 0.0)
    dp = lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=F32)
    ds = p * (dp - delta)
    if capped is not None:
        ds = ds * (1.0 - capped * capped)
    return p, ds


def _dkdv_kernel(
    geo: Geometry,
    q_list: Any,
    q_count: Any,
    q_ref: Any,
    k_ref: Any,
    v_ref: Any,
    do_ref: Any,
    lse_ref: Any,
    delta_ref: Any,
    *refs: Any,
) -> None:
    named, (dk_ref, dv_ref, dk_sc, dv_sc) = _named(geo, refs)
    b, kh, jk, g, n = (pl.program_id(a) for a in range(5))
    row = geo.list_lane(b, kh * geo.group + g) * geo.nkt + jk
    iq, partial = _entry(q_list, row, geo.nqt, n)
    live = n < q_count[row]

    @pl.when((g == 0) & (n == 0))
    def _init() -> None:
        dk_sc[...] = jnp.zeros(dk_sc.shape, F32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, F32)

    def step(masked: bool) -> None:
        q, do = q_ref[...], do_ref[...]
        p, ds = _probabilities_and_dscores(
            geo, masked, iq, jk, q, k_ref[...], v_ref[...], do, lse_ref[...], delta_ref[...], named
        )
        t_dims = (((0,), (0,)), ((), ()))  # contract the query axis: P^T dO, dS^T Q
        dv_sc[...] += lax.dot_general(p.astype(do.dtype), do, t_dims, preferred_element_type=F32)
        dk_sc[...] += lax.dot_general(ds.astype(q.dtype), q, t_dims, preferred_element_type=F32)

    pl.when(live & (partial == 1))(functools.partial(step, True))
    pl.when(live & (partial == 0))(functools.partial(step, False))

    @pl.when((g == geo.group - 1) & (n == geo.q_steps - 1))
    def _finish() -> None:
        dk_ref[...] = (dk_sc[...] * geo.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _dq_kernel(
    geo: Geometry,
    kv_list: Any,
    kv_count: Any,
    q_ref: Any,
    k_ref: Any,
    v_ref: Any,
    do_ref: Any,
    lse_ref: Any,
    delta_ref: Any,
    *refs: Any,
) -> None:
    named, (dq_ref, dq_sc) = _named(geo, refs)
    b, h, iq, n = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
    row = geo.list_lane(b, h) * geo.nqt + iq
    jk, partial = _entry(kv_list, row, geo.nkt, n)
    live = n < kv_count[row]

    @pl.when(n == 0)
    def _init() -> None:
        dq_sc[...] = jnp.zeros(dq_sc.shape, F32)

    def step(masked: bool) -> None:
        k = k_ref[...]
        _, ds = _probabilities_and_dscores(
            geo, masked, iq, jk, q_ref[...], k, v_ref[...], do_ref[...], lse_ref[...], delta_ref[...], named
        )
        dq_sc[...] += lax.dot_general(ds.astype(k.dtype), k, (((1,), (0,)), ((), ())), preferred_element_type=F32)

    pl.when(live & (partial == 1))(functools.partial(step, True))
    pl.when(live & (partial == 0))(functools.partial(step, False))

    @pl.when(n == geo.kv_steps - 1)
    def _finish() -> None:
        dq_ref[...] = (dq_sc[...] * geo.scale).astype(dq_ref.dtype)


def backward(
    geo: Geometry,
    sched: Schedule,
    q: Any,
    k: Any,
    v: Any,
    extras: list[Any],
    do: Any,
    lse: Any,
    delta: Any,
    interpret: Any,
) -> tuple[Any, Any, Any]:
    """``(dq [B, H, Tp, D], dk [B, K, Sp, D], dv [B, K, Sp, Dv])`` of padded, head-leading inputs;
    ``lse``/``delta`` are ``[B, H, Tp, 1]`` float32."""
    b, h, tp, d = q.shape
    kh, sp, dv_dim = k.shape[1], k.shape[2], v.shape[3]
    g_ = geo.group

    # dK/dV: grid over kv heads and key tiles; the G query heads and the listed query tiles are reduced.
    def head(bi: Any, khi: Any, j: Any, g: Any, *_: Any) -> Any:
        return bi, khi * g_ + g

    def q_tile(bi: Any, khi: Any, j: Any, g: Any, n: Any, lst: Any, cnt: Any) -> Any:
        return _listed(lst, cnt, geo.list_lane(bi, khi * g_ + g) * geo.nkt + j, geo.nqt, n)

    def k_tile(bi: Any, khi: Any, j: Any, *_: Any) -> Any:
        return j

    def row_spec(width: int) -> Any:
        return pl.BlockSpec((None, None, geo.bq, width), lambda *a: (a[0], a[1] * g_ + a[3], q_tile(*a), 0))

    def kv_spec(width: int) -> Any:
        return pl.BlockSpec((None, None, geo.bk, width), lambda bi, khi, j, *_: (bi, khi, j, 0))

    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, geo),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, kh, geo.nkt, g_, geo.q_steps),
            in_specs=[
                row_spec(d),
                kv_spec(d),
                kv_spec(dv_dim),
                row_spec(dv_dim),
                row_spec(1),
                row_spec(1),
                *_extra_specs(geo, head, q_tile, k_tile),
            ],
            out_specs=[kv_spec(d), kv_spec(dv_dim)],
            scratch_shapes=[pltpu.VMEM((geo.bk, d), F32), pltpu.VMEM((geo.bk, dv_dim), F32)],
        ),
        out_shape=[jax.ShapeDtypeStruct((b, kh, sp, d), k.dtype), jax.ShapeDtypeStruct((b, kh, sp, dv_dim), v.dtype)],
        compiler_params=_compiler_params(interpret, ("parallel", "parallel", "parallel", "arbitrary", "arbitrary")),
        interpret=interpret,
        name="ejkernel_block_sparse_attention_dkdv",
    )(sched.q_list, sched.q_count, q, k, v, do, lse, delta, *extras)

    # dQ: grid over query heads and query tiles; the listed key tiles are reduced.
    head, q_tile, k_tile = _by_query_tile(geo)

    def q_spec(width: int) -> Any:
        return pl.BlockSpec((None, None, geo.bq, width), lambda bi, hi, i, *_: (bi, hi, i, 0))

    def k_spec(width: int) -> Any:
        return pl.BlockSpec((None, None, geo.bk, width), lambda *a: (a[0], a[1] // g_, k_tile(*a), 0))

    dq = pl.pallas_call(
        functools.partial(_dq_kernel, geo),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, h, geo.nqt, geo.kv_steps),
            in_specs=[
                q_spec(d),
                k_spec(d),
                k_spec(dv_dim),
                q_spec(dv_dim),
                q_spec(1),
                q_spec(1),
                *_extra_specs(geo, head, q_tile, k_tile),
            ],
            out_specs=q_spec(d),
            scratch_shapes=[pltpu.VMEM((geo.bq, d), F32)],
        ),
        out_shape=jax.ShapeDtypeStruct((b, h, tp, d), q.dtype),
        compiler_params=_compiler_params(interpret, ("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="ejkernel_block_sparse_attention_dq",
    )(sched.kv_list, sched.kv_count, q, k, v, do, lse, delta, *extras)
    return dq, dk, dv
