"""Which kernel tiles each query tile visits, built from the block mask in the wrapper (``jnp``, or NumPy when static).

Shapes: B batch, H query heads, T/S query/key lengths, ``(bq, bk)`` kernel tiles, ``nqt``/``nkt`` query/key
tiles, ``(rq, rk)`` mask blocks per tile (``bq = rq * q_block``, ``bk = rk * kv_block``), ``Lb``/``Lh`` the
lanes of the lists (``B`` or 1, ``H`` or 1: what the mask and the segment ids vary over).

A tile pair is *admitted* when some token pair of it may be attended by the structure (causal, the key
length) and by the data (one of its mask blocks is True; with segment ids, the query and key tiles'
id ranges overlap), and *full* when every real query row attends every key of it (all its mask blocks
True, entirely at or below the causal diagonal, no padded key, one segment id shared by both tiles).
Full pairs skip the token mask in the kernels; the other admitted pairs are *partial*.

For every lane and query tile, the admitted key tiles are listed in increasing order, then padding;
each entry is ``2 * tile + partial``. The transposed lists (per key tile, the query tiles that admit it)
drive the dK/dV kernel. Lists and counts are flat int32 arrays (scalar prefetch: a 2-D SMEM array
would pad its rows to 128 entries).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

I32 = jnp.int32


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Static lengths, kernel tiles and the mask's granularity (``q_block``/``kv_block`` are 1 without a mask)."""

    t: int
    s: int
    bq: int
    bk: int
    q_block: int
    kv_block: int
    causal: bool

    @property
    def offset(self) -> int:
        return self.s - self.t  # bottom-right alignment: query i sits at key position i + S - T

    @property
    def nqt(self) -> int:
        return -(-self.t // self.bq)

    @property
    def nkt(self) -> int:
        return -(-self.s // self.bk)

    @property
    def rq(self) -> int:
        return self.bq // self.q_block

    @property
    def rk(self) -> int:
        return self.bk // self.kv_block


def tile_pairs(xp: Any, tl: Tiling, mask: Any) -> tuple[Any, Any]:
    """``(admitted, full)`` ``[Lb, Lh, nqt, nkt]`` booleans of the structure and the block mask (``[Lb, Lh, NQ, NK]``
    or None), without segment ids; ``xp`` is ``numpy`` (static schedules) or ``jax.numpy``."""
    i = xp.arange(tl.nqt)[:, None]
    j = xp.arange(tl.nkt)[None, :]
    first_pos = i * tl.bq + tl.offset  # aligned positions of the tile's first and last real query row
    last_pos = xp.minimum((i + 1) * tl.bq, tl.t) - 1 + tl.offset
    admitted = xp.ones((tl.nqt, tl.nkt), bool)
    full = (j + 1) * tl.bk <= tl.s  # a tile holding padded keys always needs the token mask
    if tl.causal:
        admitted = admitted & (j * tl.bk <= last_pos)
        full = full & ((j + 1) * tl.bk - 1 <= first_pos)
    admitted, full = admitted[None, None], full[None, None]
    if mask is not None:
        nq, nk = mask.shape[2:]
        if tl.causal:  # mask blocks wholly after the diagonal admit nothing: do not let them admit a tile
            qb = xp.arange(nq)[:, None]
            kb = xp.arange(nk)[None, :]
            mask = mask & (kb * tl.kv_block <= xp.minimum((qb + 1) * tl.q_block, tl.t) - 1 + tl.offset)
        some = _blocks_per_tile(xp, tl, mask, False).any(axis=(3, 5))
        every = _blocks_per_tile(xp, tl, mask, True).all(axis=(3, 5))
        admitted = admitted & some
        full = full & every
    return admitted, full & admitted


def _blocks_per_tile(xp: Any, tl: Tiling, mask: Any, fill: bool) -> Any:
    """``[Lb, Lh, NQ, NK]`` -> ``[Lb, Lh, nqt, rq, nkt, rk]``, the mask padded with ``fill`` to whole tiles."""
    lb, lh, nq, nk = mask.shape
    pad = ((0, 0), (0, 0), (0, tl.nqt * tl.rq - nq), (0, tl.nkt * tl.rk - nk))
    return xp.pad(mask, pad, constant_values=fill).reshape(lb, lh, tl.nqt, tl.rq, tl.nkt, tl.rk)


def static_steps(tl: Tiling, mask: np.ndarray | None) -> tuple[int, int]:
    """Grid lengths ``(key tiles per query tile, query tiles per key tile)``: the longest lists over lanes and tiles.

    From what is known before the call runs: the structure and a concrete mask (a traced mask counts as
    all True). Segment ids only remove tiles, so these bound the traced lists. At least 1: the kernels
    write their outputs on the last step, also when nothing is admitted.
    """
    admitted, _ = tile_pairs(np, tl, mask)
    return max(1, int(admitted.sum(axis=-1).max())), max(1, int(admitted.sum(axis=-2).max()))


def concrete(x: Any) -> np.ndarray | None:
    """``x`` as a NumPy array when its value is known at trace time, else None."""
    if x is None or isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One pass's lists (flat int32, see the module docstring) and the per-tile-pair mask blocks."""

    lanes: tuple[int, int]  # (Lb, Lh) of the lists
    kv_list: jax.Array  # [Lb * Lh * nqt * nkt]: key tiles per (lane, query tile)
    kv_count: jax.Array  # [Lb * Lh * nqt]
    q_list: jax.Array  # [Lb * Lh * nkt * nqt]: query tiles per (lane, key tile)
    q_count: jax.Array  # [Lb * Lh * nkt]
    sub: jax.Array | None  # [Mb * Mh, nqt, nkt, rq, rk] int32 mask blocks of each tile pair; None when not needed


def _lists(admitted: jax.Array, partial: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``[L, n, m]`` -> (flat entries ``2 * index + partial``, admitted indices first in order; flat counts)."""
    code = jnp.arange(admitted.shape[-1], dtype=I32) * 2 + partial.astype(I32)
    order = jnp.argsort(jnp.logical_not(admitted).astype(jnp.int8), axis=-1, stable=True)
    entries = jnp.take_along_axis(code, order, axis=-1)
    return entries.reshape(-1).astype(I32), admitted.sum(axis=-1, dtype=I32).reshape(-1)


def _segment_pairs(tl: Tiling, qseg: jax.Array, kseg: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(overlap, uniform)`` ``[B, nqt, nkt]``: the tiles' id ranges overlap; both tiles hold one and the same id."""
    b = qseg.shape[0]
    # Edge padding keeps each tile's range that of its real tokens.
    qs = jnp.pad(qseg.astype(I32), ((0, 0), (0, tl.nqt * tl.bq - tl.t)), mode="edge").reshape(b, tl.nqt, tl.bq)
    ks = jnp.pad(kseg.astype(I32), ((0, 0), (0, tl.nkt * tl.bk - tl.s)), mode="edge").reshape(b, tl.nkt, tl.bk)
    q_lo, q_hi = qs.min(-1)[:, :, None], qs.max(-1)[:, :, None]
    k_lo, k_hi = ks.min(-1)[:, None, :], ks.max(-1)[:, None, :]
    overlap = (q_lo <= k_hi) & (k_lo <= q_hi)
    uniform = (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)
    return overlap, uniform


def build(tl: Tiling, mask: jax.Array | None, qseg: jax.Array | None, kseg: jax.Array | None) -> Schedule:
    """The schedule of one pass (traced: the mask and segment ids may be data)."""
    admitted, full = tile_pairs(jnp, tl, mask)
    if qseg is not None and kseg is not None:
        overlap, uniform = _segment_pairs(tl, qseg, kseg)
        admitted = admitted & overlap[:, None]
        full = full & uniform[:, None] & admitted
    lb, lh = admitted.shape[:2]
    admitted = admitted.reshape(lb * lh, tl.nqt, tl.nkt)
    partial = admitted & jnp.logical_not(full.reshape(lb * lh, tl.nqt, tl.nkt))
    kv_list, kv_count = _lists(admitted, partial)
    q_list, q_count = _lists(admitted.transpose(0, 2, 1), partial.transpose(0, 2, 1))
    sub = None
    if mask is not None and tl.rq * tl.rk > 1:  # with one mask block per tile, admitted means all True
        mb, mh = mask.shape[:2]
        blocks = _blocks_per_tile(jnp, tl, mask, False).transpose(0, 1, 2, 4, 3, 5)
        sub = blocks.reshape(mb * mh, tl.nqt, tl.nkt, tl.rq, tl.rk).astype(I32)
    return Schedule((lb, lh), kv_list, kv_count, q_list, q_count, sub)
