"""Mosaic TPU grouped matmul kernels: ``gmm`` (``out = lhs_g @ rhs[g]``) and ``tgmm`` (``d rhs[g] = lhs_g^T @ d out_g``).

Shapes: M rows, K contraction dim, N output columns, G groups; ``tm``/``tk``/``tn`` their tiles. The
caller pads M, K and N to tile multiples (zeros), so every block is whole.

Both kernels walk a *schedule* of visits, built from ``group_sizes`` by XLA before the kernel and
handed to it by scalar prefetch (SMEM), so that the index maps can read it:

- the rows are cut into tiles of ``tm``; a group visits each row tile it overlaps, so a tile that
  straddles a group boundary is visited once per group it meets (consecutively: the groups are sorted),
  and each visit keeps only its own group's rows (a row mask from the group offsets);
- the number of visits depends on the data; the grid takes its static bound ``row tiles + G`` and the
  visits past the real ones do nothing, with index maps that repeat the last blocks (no DMA).

``gmm``'s visits cover every row tile at least once: after the groups comes a *tail* of the rows past
``sum(group_sizes)``, whose tiles are visited with no matmul, only to write their zeros. An empty group
has no visit. ``tgmm``'s visits cover every group at least once: an empty group gets one visit with no
matmul, to write its zero gradient.

Per visit the schedule holds its group, its row tile and flags (``FIRST``/``ACTIVE``/``LAST``); a visit
that is not ``ACTIVE`` points its index maps at the blocks of the last active visit, so the pipeline
keeps the resident blocks instead of fetching new ones.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

F32 = jnp.float32
I32 = jnp.int32
FIRST, ACTIVE, LAST = 1, 2, 4  # flag bits of a visit


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The visits of one kernel: ``offsets [G + 1]`` (group ``g`` is rows ``offsets[g]:offsets[g + 1]``, cut
    at M), and per visit ``group [W]``, ``tile [W]`` (the row tile), ``fetch [W]`` (the row tile whose
    blocks the index maps load: the visit's own when active, else the last active visit's) and ``flags [W]``."""

    offsets: jax.Array
    group: jax.Array
    tile: jax.Array
    fetch: jax.Array
    flags: jax.Array

    def operands(self) -> tuple[jax.Array, ...]:
        return self.offsets, self.group, self.tile, self.fetch, self.flags


def num_visits(m_pad: int, tm: int, g: int) -> int:
    """The static bound on the visits: each group boundary inside a row tile adds one visit to the tiles."""
    return m_pad // tm + g


def schedule(group_sizes: jax.Array, m: int, m_pad: int, tm: int, *, for_tgmm: bool) -> Schedule:
    """The visits of ``gmm`` (``for_tgmm=False``: every row tile, groups then the tail of rows in no group)
    or of ``tgmm`` (every group, an empty one once), sorted by group then row tile."""
    g = group_sizes.shape[0]
    tiles = m_pad // tm
    w = num_visits(m_pad, tm, g)
    ends = jnp.clip(jnp.cumsum(group_sizes.astype(I32)), 0, m)
    starts = jnp.concatenate([jnp.zeros((1,), I32), ends[:-1]])
    offsets = jnp.concatenate([jnp.zeros((1,), I32), ends])
    # Segments: the groups, and for gmm the tail [sum(group_sizes), m) of rows in no group.
    seg_start, seg_end = starts, ends
    if not for_tgmm:
        seg_start = jnp.concatenate([starts, ends[-1:]])
        seg_end = jnp.concatenate([ends, jnp.full((1,), m, I32)])
    n_seg = seg_start.shape[0]
    nonempty = seg_end > seg_start
    first_tile = jnp.minimum(seg_start // tm, tiles - 1)
    counts = jnp.where(nonempty, (seg_end - 1) // tm - seg_start // tm + 1, 1 if for_tgmm else 0)
    cum = jnp.cumsum(counts)
    begin = cum - counts

    v = jnp.arange(w, dtype=I32)
    seg = jnp.searchsorted(cum, v, side="right").astype(I32)  # segment of each visit; n_seg past the real ones
    valid = seg < n_seg
    seg = jnp.minimum(seg, n_seg - 1)
    tile = jnp.where(valid, first_tile[seg] + v - begin[seg], tiles - 1)
    active = valid & nonempty[seg] & (seg < g)  # the tail (segment G) multiplies nothing
    group = jnp.where(valid, jnp.minimum(seg, g - 1), g - 1)

    # Inactive visits load the blocks of the last active visit before them (or of the first active one).
    last_active = lax.cummax(jnp.where(active, v, -1))
    source = jnp.where(last_active >= 0, last_active, jnp.argmax(active).astype(I32))
    fetch = tile[source]

    def differs_from_previous(x: jax.Array) -> jax.Array:
        return jnp.concatenate([jnp.ones((1,), bool), x[1:] != x[:-1]])

    if for_tgmm:
        first = valid & differs_from_previous(group)
        last = valid & jnp.concatenate([(group[1:] != group[:-1]) | ~valid[1:], jnp.ones((1,), bool)])
        flags = first * FIRST + active * ACTIVE + last * LAST
    else:
        first = valid & differs_from_previous(tile)
        flags = first * FIRST + active * ACTIVE
        group = group[source]  # an inactive visit fetches the last active visit's rhs block
    return Schedule(offsets, group, tile, fetch, flags.astype(I32))


def _compiler_params(interpret: Any, semantics: tuple[Literal["parallel", "arbitrary"], ...]) -> Any:
    if interpret:
        # JAX's TPU interpreter does not extend dimension_semantics by the grid axes that vmap prepends
        # (Mosaic's lowering does), so interpreted kernels leave them unset: every axis sequential.
        return pltpu.CompilerParams()
    return pltpu.CompilerParams(dimension_semantics=semantics)


def _row_mask(shape: tuple[int, int], tm: int, tile: Any, lo: Any, hi: Any) -> Any:
    """Which rows of a ``[tm, *]`` block of row tile ``tile`` lie in ``[lo, hi)``."""
    rows = tile * tm + lax.broadcasted_iota(I32, shape, 0)
    return (rows >= lo) & (rows < hi)


# -------------------------------------------------------------------------------------------- gmm


@dataclasses.dataclass(frozen=True)
class GmmGeometry:
    """Tiles of one ``gmm``: ``tm`` rows, ``tc`` of the contracted dim, ``to`` of the output columns."""

    tm: int
    tc: int
    to: int
    transpose_rhs: bool  # rhs is [G, out, contracted] rather than [G, contracted, out]
    compute_dtype: str  # both operands are cast to it per block (the product accumulates in float32)


def _gmm_kernel(
    geo: GmmGeometry,
    offsets_ref: Any,
    group_ref: Any,
    tile_ref: Any,
    fetch_ref: Any,
    flags_ref: Any,
    lhs_ref: Any,
    rhs_ref: Any,
    out_ref: Any,
    acc_ref: Any,
) -> None:
    i, c = pl.program_id(1), pl.program_id(2)
    last_c = c == pl.num_programs(2) - 1
    flags = flags_ref[i]
    first, active = (flags & FIRST) != 0, (flags & ACTIVE) != 0

    @pl.when(active & (c == 0))
    def _init() -> None:
        acc_ref[...] = jnp.zeros(acc_ref.shape, F32)

    @pl.when(active)
    def _accumulate() -> None:
        dims = (((1,), (1,)), ((), ())) if geo.transpose_rhs else (((1,), (0,)), ((), ()))
        b_lhs = lhs_ref[...].astype(geo.compute_dtype)  # [tm, tc]
        b_rhs = rhs_ref[0].astype(geo.compute_dtype)  # [tc, to] or [to, tc]
        acc_ref[...] += lax.dot_general(b_lhs, b_rhs, dims, preferred_element_type=F32)

    # The output tile stays resident over the consecutive visits of its row tile: the first visit writes
    # every row (zeros outside its group), the later ones only their own group's rows.
    def mask() -> Any:
        g = group_ref[i]
        return _row_mask(acc_ref.shape, geo.tm, tile_ref[i], offsets_ref[g], offsets_ref[g + 1])

    @pl.when(active & first & last_c)
    def _store_first() -> None:
        out_ref[...] = jnp.where(mask(), acc_ref[...], 0.0).astype(out_ref.dtype)

    @pl.when(active & jnp.logical_not(first) & last_c)
    def _store_more() -> None:
        # selected in float32 (exact for the output dtypes): packed bfloat16 selects are not on every chip
        out_ref[...] = jnp.where(mask(), acc_ref[...], out_ref[...].astype(F32)).astype(out_ref.dtype)

    @pl.when(jnp.logical_not(active) & first & last_c)
    def _store_zeros() -> None:  # a row tile of no group
        out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)


def gmm(geo: GmmGeometry, sched: Schedule, lhs: jax.Array, rhs: jax.Array, out_dtype: Any, interpret: Any) -> jax.Array:
    """``out [M_pad, O_pad]``: row ``r`` of group ``g`` is ``lhs[r] @ rhs[g]`` (``rhs[g].T`` with
    ``transpose_rhs``), rows in no group zero. ``lhs [M_pad, C_pad]``; ``rhs [G, C_pad, O_pad]`` or
    ``[G, O_pad, C_pad]``; every dim a multiple of its tile."""
    m_pad, c_pad = lhs.shape
    o_pad = rhs.shape[1] if geo.transpose_rhs else rhs.shape[2]
    nc, no = c_pad // geo.tc, o_pad // geo.to
    w = sched.group.shape[0]

    def active_c(i: Any, c: Any, flags_ref: Any) -> Any:
        # an inactive visit keeps the last active visit's final contraction block resident
        return jnp.where((flags_ref[i] & ACTIVE) != 0, c, nc - 1)

    def lhs_map(j: Any, i: Any, c: Any, offsets: Any, group: Any, tile: Any, fetch: Any, flags: Any) -> Any:
        return fetch[i], active_c(i, c, flags)

    def rhs_map(j: Any, i: Any, c: Any, offsets: Any, group: Any, tile: Any, fetch: Any, flags: Any) -> Any:
        cc = active_c(i, c, flags)
        return (group[i], j, cc) if geo.transpose_rhs else (group[i], cc, j)

    def out_map(j: Any, i: Any, c: Any, offsets: Any, group: Any, tile: Any, fetch: Any, flags: Any) -> Any:
        return tile[i], j

    rhs_block = (1, geo.to, geo.tc) if geo.transpose_rhs else (1, geo.tc, geo.to)
    itemsize = jnp.dtype(lhs.dtype).itemsize
    cost = pl.CostEstimate(
        flops=2 * m_pad * c_pad * o_pad,
        transcendentals=0,
        bytes_accessed=int(lhs.size * itemsize * no + rhs.size * jnp.dtype(rhs.dtype).itemsize)
        + m_pad * o_pad * jnp.dtype(out_dtype).itemsize,
    )
    return pl.pallas_call(
        functools.partial(_gmm_kernel, geo),
        out_shape=jax.ShapeDtypeStruct((m_pad, o_pad), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(no, w, nc),
            in_specs=[pl.BlockSpec((geo.tm, geo.tc), lhs_map), pl.BlockSpec(rhs_block, rhs_map)],
            out_specs=pl.BlockSpec((geo.tm, geo.to), out_map),
            scratch_shapes=[pltpu.VMEM((geo.tm, geo.to), F32)],
        ),
        # Consecutive visits share an output tile, so the visit axis is sequential too.
        compiler_params=_compiler_params(interpret, ("parallel", "arbitrary", "arbitrary")),
        interpret=interpret,
        cost_estimate=cost,
        name="ejkernel_grouped_matmul_gmm",
    )(*sched.operands(), lhs, rhs)


# ------------------------------------------------------------------------------------------- tgmm


@dataclasses.dataclass(frozen=True)
class TgmmGeometry:
    """Tiles of one ``tgmm``: ``tm`` rows (the contracted dim), ``tk``/``tn`` of the two output dims."""

    tm: int
    tk: int
    tn: int
    transpose_out: bool  # write [G, N, K] (``dout^T lhs``) rather than [G, K, N]
    compute_dtype: str


def _tgmm_kernel(
    geo: TgmmGeometry,
    offsets_ref: Any,
    group_ref: Any,
    tile_ref: Any,
    fetch_ref: Any,
    flags_ref: Any,
    lhs_ref: Any,
    dout_ref: Any,
    out_ref: Any,
    acc_ref: Any,
) -> None:
    i = pl.program_id(2)
    flags = flags_ref[i]

    @pl.when((flags & FIRST) != 0)
    def _init() -> None:
        acc_ref[...] = jnp.zeros(acc_ref.shape, F32)

    g, tile = group_ref[i], tile_ref[i]
    lo, hi = offsets_ref[g], offsets_ref[g + 1]
    active = (flags & ACTIVE) != 0
    whole = (tile * geo.tm >= lo) & ((tile + 1) * geo.tm <= hi)  # every row of the tile in the group

    def accumulate(masked: bool) -> None:
        b_lhs = lhs_ref[...]  # [tm, tk]
        if masked:  # zero the other groups' rows (selected in float32, exact: see _gmm_kernel)
            keep = _row_mask(b_lhs.shape, geo.tm, tile, lo, hi)
            b_lhs = jnp.where(keep, b_lhs.astype(F32), 0.0)
        b_lhs = b_lhs.astype(geo.compute_dtype)
        b_dout = dout_ref[...].astype(geo.compute_dtype)  # [tm, tn]
        rows = (((0,), (0,)), ((), ()))  # contract the rows
        if geo.transpose_out:
            acc_ref[...] += lax.dot_general(b_dout, b_lhs, rows, preferred_element_type=F32)  # [tn, tk]
        else:
            acc_ref[...] += lax.dot_general(b_lhs, b_dout, rows, preferred_element_type=F32)  # [tk, tn]

    pl.when(active & whole)(lambda: accumulate(masked=False))
    pl.when(active & jnp.logical_not(whole))(lambda: accumulate(masked=True))

    @pl.when((flags & LAST) != 0)
    def _store() -> None:
        out_ref[0] = acc_ref[...].astype(out_ref.dtype)


def tgmm(
    geo: TgmmGeometry, sched: Schedule, lhs: jax.Array, dout: jax.Array, num_groups: int, out_dtype: Any, interpret: Any
) -> jax.Array:
    """``d rhs [G, K_pad, N_pad]`` (``[G, N_pad, K_pad]`` with ``transpose_out``): ``lhs_g^T @ dout_g`` over the
    rows of each group, zero for an empty group. ``lhs [M_pad, K_pad]``, ``dout [M_pad, N_pad]``."""
    m_pad, k_pad = lhs.shape
    n_pad = dout.shape[1]
    nk, nn = k_pad // geo.tk, n_pad // geo.tn
    w = sched.group.shape[0]

    def lhs_map(kk: Any, j: Any, i: Any, offsets: Any, group: Any, tile: Any, fetch: Any, flags: Any) -> Any:
        return fetch[i], kk

    def dout_map(kk: Any, j: Any, i: Any, offsets: Any, group: Any, tile: Any, fetch: Any, flags: Any) -> Any:
        return fetch[i], j

    def out_map(kk: Any, j: Any, i: Any, offsets: Any, group: Any, tile: Any, fetch: Any, flags: Any) -> Any:
        return (group[i], j, kk) if geo.transpose_out else (group[i], kk, j)

    if geo.transpose_out:
        out_block, out_shape, acc = (1, geo.tn, geo.tk), (num_groups, n_pad, k_pad), (geo.tn, geo.tk)
    else:
        out_block, out_shape, acc = (1, geo.tk, geo.tn), (num_groups, k_pad, n_pad), (geo.tk, geo.tn)
    cost = pl.CostEstimate(
        flops=2 * m_pad * k_pad * n_pad,
        transcendentals=0,
        bytes_accessed=int(
            lhs.size * jnp.dtype(lhs.dtype).itemsize * nn + dout.size * jnp.dtype(dout.dtype).itemsize * nk
        )
        + num_groups * k_pad * n_pad * jnp.dtype(out_dtype).itemsize,
    )
    return pl.pallas_call(
        functools.partial(_tgmm_kernel, geo),
        out_shape=jax.ShapeDtypeStruct(out_shape, out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(nk, nn, w),
            in_specs=[pl.BlockSpec((geo.tm, geo.tk), lhs_map), pl.BlockSpec((geo.tm, geo.tn), dout_map)],
            out_specs=pl.BlockSpec(out_block, out_map),
            scratch_shapes=[pltpu.VMEM(acc, F32)],
        ),
        compiler_params=_compiler_params(interpret, ("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        cost_estimate=cost,
        name="ejkernel_grouped_matmul_tgmm",
    )(*sched.operands(), lhs, dout)
