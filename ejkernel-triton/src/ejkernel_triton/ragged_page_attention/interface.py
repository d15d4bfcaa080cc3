"""Triton ``ragged_page_attention``: decode rows on the split-K kernel, prefill rows in flash-style query tiles.

One call is two launches, split by sequence:

* a sequence of one query row (``q_len <= 1``: decoding) is one decode row of the split-K kernel
  (``ejkernel_triton._decode_kernels.split_kv_decode``), one slot per sequence, its table row as is: the launch
  covers the ``S`` sequence slots (sequences of other kinds, and slots past ``num_seqs``, get an empty interval);
* the rows of a longer sequence (prefill, chunked prefill, several tokens of a speculative step) run in the
  prefill kernel (``ejkernel_triton._prefill_kernels.ragged_prefill``): query tiles of ``BLOCK_M // G`` rows of one
  sequence times the ``G`` query heads of a kv head, over key blocks gathered through the block table, with
  causal block skipping (and the blocks before a sliding window skipped). Its tile table (which sequence, which
  first row, how many rows, which position) is computed on the device from ``cu_q_lens``/``num_seqs`` with a few
  XLA ops, for a static number of tiles, ``T // (BLOCK_M // G) + S``, of which the programs past the real count
  exit at once; so the call works under ``jit``.

Each output row is taken from the one launch that owns it (a select XLA fuses); padding rows (past
``cu_q_lens[num_seqs]``) are zeros. Under ``jit`` (unchecked metadata) ``cu_q_lens`` is clamped into ``[0, T]``
and made non-decreasing, page indices are clamped into ``[0, P)`` and positions into the table's capacity: no
value makes a kernel read outside the cache. Launch parameters: :class:`RaggedPageParams` (the decode
launch's :class:`~ejkernel_triton._decode.PagedDecodeParams` fields, and the prefill tiles'). Not
differentiable; no backward (``ForwardOnly``). Under ``jax.vmap`` the decode launch folds the batch into its
rows; the prefill launch runs once per element.

Importing this module does not import Triton.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.device import cdiv, next_power_of_2
from ejkernel.kernels.params import check_positive, coerce
from ejkernel.kernels.signatures._serving import fold_cache_scales, refuse_gradients

from ejkernel_triton._decode import (
    ForwardOnly,
    PagedDecodeParams,
    _smem_bytes,
    arguments,
    decode,
    interpreting,
    supports_decode,
)
from ejkernel_triton.page_attention.interface import _params, _plan

__all__ = ["RaggedPageParams", "candidate_cfgs", "heuristic_cfg", "ragged_page_attention", "supports"]

OP = "ragged_page_attention"
DECODE_MAX_Q = 1  # sequences of at most this many query rows run on the split-K decode kernel
_MAX_POSITION = 1 << 30  # kv_lens are clamped below this (unchecked metadata never overflows int32)


@dataclasses.dataclass(frozen=True)
class RaggedPageParams(PagedDecodeParams):
    """Launch parameters of the Triton ``ragged_page_attention``.

    The decode launch's fields are :class:`~ejkernel_triton._decode.PagedDecodeParams`' (``num_splits``,
    ``pages_per_block``, ``num_warps``, ``num_stages``; generic ``num_warps``/``num_stages`` map to them). The
    prefill launch's: ``prefill_block_m``, the rows of one tile (query rows times the ``G = H // K`` query heads of
    a kv head, packed: a tile holds ``prefill_block_m // G`` query rows), a power of two >= 16 (raised to ``G``
    where smaller); ``prefill_block_n``, keys per step, a power of two >= 16; ``prefill_num_warps`` (a power of
    two), ``prefill_num_stages``. None: the heuristic (:func:`heuristic_cfg`).
    """

    prefill_block_m: int | None = None
    prefill_block_n: int | None = None
    prefill_num_warps: int | None = None
    prefill_num_stages: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("prefill_block_m", "prefill_block_n"):
            check_positive(self, name, power_of_two=True)
            value = getattr(self, name)
            if value is not None and value < 16:
                raise ValueError(f"RaggedPageParams.{name} must be a power of two >= 16 or None, got {value!r}")
        check_positive(self, "prefill_num_warps", power_of_two=True)
        check_positive(self, "prefill_num_stages")


def _as_params(params: Any) -> RaggedPageParams:
    """``params`` (None, a :class:`RaggedPageParams`, the decode kernel's ``PagedDecodeParams`` or the generic
    ``FwdParams``) as :class:`RaggedPageParams`."""
    if isinstance(params, PagedDecodeParams) and not isinstance(params, RaggedPageParams):
        return RaggedPageParams(**dataclasses.asdict(params))
    return coerce(RaggedPageParams, params) or RaggedPageParams()


# ------------------------------------------------------------------------------------------------
# The prefill launch's plan.
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PrefillPlan:
    """The prefill launch: packed rows per tile (``block_m``), keys per step, warps, stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def _pow2(n: int) -> int:
    return max(16, next_power_of_2(n))


def _prefill_buffers(stages: int) -> int:
    """K/V tiles Triton 3.6's pipeliner buffers for the prefill loop: the table entries take a stage of their own
    (the keys' addresses depend on them), so the keys run ``(stages - 1) // 2`` blocks ahead (5 stages: two, as
    the flash forward's 3), in one buffer more (at least two)."""
    return max(2, (stages - 1) // 2 + 1)


def _prefill_smem(bm: int, bn: int, stages: int, bd: int, bdv: int, e: int) -> int:
    # the query tile, the buffered K and V tiles and table entries, and Triton's scratch (sm_90, Triton 3.6: within
    # 1 KiB of what it allocates for 128 x 64 tiles of D=128 in 5 stages, 129 KiB)
    bufs = _prefill_buffers(stages)
    return e * (bm * bd + bufs * bn * (bd + bdv)) + 4 * bn * bufs + 1024


def _prefill_fits(bm: int, bn: int, warps: int, stages: int, bd: int, bdv: int, e: int) -> bool:
    # Shared memory, and the float32 accumulator and score tiles per thread: past 128 (the row bookkeeping and the
    # gathered addresses take the rest) the kernel spills (sm_90, Triton 3.6: 128 x 64 tiles of D=128 in 4 warps).
    return _prefill_smem(bm, bn, stages, bd, bdv, e) <= _smem_bytes() and (bm * bdv + bm * bn) / (32 * warps) <= 128


def _prefill_default(t: int, g: int, d: int, dv: int, e: int) -> tuple[int, int, int, int]:
    """(rows per tile, keys per step, warps, stages) on Hopper: the flash forward's tiles (a tile's rows are query
    rows times heads here; 8 warps for head dims of 256, where 4 spill) in 5 stages, which keep the keys two blocks
    ahead like the flash forward's 3 (:func:`_prefill_buffers`; 3 stages, one block ahead, for head dims of 256,
    whose three buffers would fill shared memory), no taller than ``T * G`` rows. float32 (dots on the FMA units,
    which spill on large tiles) takes 64 x 32 tiles; then stages drop, and the blocks halve, until the buffered
    tiles fit in shared memory."""
    if interpreting():
        return _pow2(g), 16, 4, 1
    bd, bdv = _pow2(d), _pow2(dv)
    big = max(bd, bdv)
    if e >= 4:
        bm, bn, warps, stages = 64, 32, 8, 3
    elif big <= 64:
        bm, bn, warps, stages = 128, 64, 4, 5
    elif big <= 128:
        bm, bn, warps, stages = 128, 64, 8, 5
    else:
        bm, bn, warps, stages = 64, 64, 8, 3
    bm = max(_pow2(g), min(bm, _pow2(t * g)))
    while not _prefill_fits(bm, bn, warps, stages, bd, bdv, e):
        if stages > 1:
            stages -= 1
        elif bn > 16:
            bn //= 2
        elif bm > max(16, _pow2(g)):
            bm //= 2
        else:
            break
    return bm, bn, warps, stages


def _prefill_plan(t: int, g: int, d: int, dv: int, e: int, p: RaggedPageParams) -> PrefillPlan:
    bm, bn, warps, stages = _prefill_default(t, g, d, dv, e)
    return PrefillPlan(
        max(_pow2(g), p.prefill_block_m or bm),
        p.prefill_block_n or bn,
        p.prefill_num_warps or warps,
        p.prefill_num_stages or stages,
    )


def _prefill_candidates(t: int, g: int, d: int, dv: int, e: int) -> list[PrefillPlan]:
    """Prefill launches worth timing, the heuristic's first: the flash forward's grid (tiles of 64 or 128 rows and
    keys, 4 or 8 warps) in 5 stages (3 for head dims above 128), and the heuristic's tiles in 3 stages; none that
    overflows shared memory or spills. float32: the heuristic's alone (larger tiles of FMA dots spill)."""
    base = PrefillPlan(*_prefill_default(t, g, d, dv, e))
    if interpreting():
        return [base, PrefillPlan(max(32, _pow2(g)), 16, 4, 1), PrefillPlan(_pow2(g), 32, 4, 1)]
    if e >= 4:
        return [base]
    bd, bdv = _pow2(d), _pow2(dv)
    stages = 5 if max(bd, bdv) <= 128 else 3
    grid = [PrefillPlan(max(bm, _pow2(g)), bn, w, stages) for bm in (64, 128) for bn in (64, 128) for w in (4, 8)]
    grid.append(PrefillPlan(base.block_m, base.block_n, base.num_warps, 3))
    out = [base]
    for plan in grid:
        if plan not in out and _prefill_fits(plan.block_m, plan.block_n, plan.num_warps, plan.num_stages, bd, bdv, e):
            out.append(plan)
    return out


# ------------------------------------------------------------------------------------------------
# Hooks: supports, heuristic, candidates.
# ------------------------------------------------------------------------------------------------


def _dims(inv: Any) -> tuple[int, int, int, int, int, int, int, int, int, int]:
    """(T, S, G, KH, max keys, D, Dv, bytes per query element, bytes per cache element, page) of a call."""
    args = arguments(inv)
    q, kc, vc, tables = args["query"], args["key_cache"], args["value_cache"], args["block_tables"]
    page, kh = int(kc.shape[1]), int(kc.shape[2])
    e = int(np.dtype(q.dtype).itemsize)
    ec = int(np.dtype(kc.dtype).itemsize)
    slots, g = int(tables.shape[0]), int(q.shape[1]) // max(kh, 1)
    return int(q.shape[0]), slots, g, kh, int(tables.shape[1]) * page, int(q.shape[-1]), int(vc.shape[-1]), e, ec, page


def _with_prefill(decode_params: PagedDecodeParams, plan: PrefillPlan) -> RaggedPageParams:
    return RaggedPageParams(
        **dataclasses.asdict(decode_params),
        prefill_block_m=plan.block_m,
        prefill_block_n=plan.block_n,
        prefill_num_warps=plan.num_warps,
        prefill_num_stages=plan.num_stages,
    )


def heuristic_cfg(inv: Any, stage: str = "fwd") -> RaggedPageParams | ForwardOnly:
    if stage != "fwd":
        return ForwardOnly()  # not differentiable: nothing to tune
    t, slots, g, kh, keys, d, dv, e, ec, page = _dims(inv)
    dec = _params(_plan(slots, kh, keys, d, dv, ec, page, PagedDecodeParams()), page)
    return _with_prefill(dec, _prefill_plan(t, g, d, dv, e, RaggedPageParams()))


def candidate_cfgs(inv: Any, stage: str = "fwd") -> list[RaggedPageParams] | list[ForwardOnly]:
    """The heuristic's launch first, then one launch varied at a time: the decode launch's candidates (those of
    ``page_attention`` over the ``S`` slots) with the heuristic's prefill tiles, then the prefill tiles' with the
    heuristic's decode launch."""
    if stage != "fwd":
        return [ForwardOnly()]
    from ejkernel_triton.page_attention.interface import candidate_cfgs as paged_candidates

    t, slots, g, kh, keys, d, dv, e, ec, page = _dims(inv)
    plan = _prefill_plan(t, g, d, dv, e, RaggedPageParams())
    base_dec = _params(_plan(slots, kh, keys, d, dv, ec, page, PagedDecodeParams()), page)
    args = arguments(inv)
    as_paged = {"query": jax.ShapeDtypeStruct((slots, *args["query"].shape[1:]), args["query"].dtype)}
    as_paged |= {k: args[k] for k in ("key_cache", "value_cache", "block_tables")}
    out = [_with_prefill(base_dec, plan)]
    for dec in paged_candidates(as_paged, stage):
        assert isinstance(dec, PagedDecodeParams)
        out.append(_with_prefill(dec, plan))
    out += [_with_prefill(base_dec, p) for p in _prefill_candidates(t, g, d, dv, e)]
    return list(dict.fromkeys(out))


def supports(inv: Any) -> str | None:
    args = arguments(inv)
    return supports_decode(OP, args["query"], args["key_cache"], args["value_cache"])


# ------------------------------------------------------------------------------------------------
# Metadata (XLA ops on the device) and the prefill launch.
# ------------------------------------------------------------------------------------------------


def _offsets(t: int, slots: int, cu_q_lens: Any, num_seqs: Any) -> jax.Array:
    """``cu_q_lens [S+1]`` of the live sequences, clamped into ``[0, T]`` and non-decreasing; the slots past
    ``num_seqs`` hold the last live offset (their sequences are empty)."""
    n = jnp.clip(jnp.asarray(num_seqs, jnp.int32).reshape(-1)[0], 0, slots)
    cu = jnp.asarray(cu_q_lens).astype(jnp.int32)
    cu = jnp.clip(cu[jnp.minimum(jnp.arange(slots + 1), n)], 0, t)
    return jax.lax.cummax(cu)


def _tiles(t: int, n_tiles: int, block_q: int, cu: jax.Array, kv: jax.Array) -> jax.Array:
    """The prefill tile table ``[n_tiles, 4]`` int32: per tile (sequence, first row, rows, position of its first
    row); tiles past the real count have 0 rows. A sequence's tiles come last first (the longest first: it sees
    the most keys)."""
    slots = kv.shape[0]
    q_len = cu[1:] - cu[:-1]
    counts = jnp.where(q_len > DECODE_MAX_Q, cdiv(q_len, block_q), 0)
    ends = jnp.cumsum(counts)
    ids = jnp.arange(n_tiles, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(ends, ids, side="right", method="compare_all").astype(jnp.int32), 0, slots - 1)
    j = ends[seq] - 1 - ids  # tile of its sequence, counted from the end
    row0 = cu[seq] + j * block_q
    rows = jnp.where(ids < ends[-1], jnp.clip(cu[seq + 1] - row0, 0, block_q), 0)
    pos0 = kv[seq] - q_len[seq] + j * block_q
    return jnp.stack([seq, row0, rows, pos0], axis=1).astype(jnp.int32)


def _launch_prefill(
    plan: PrefillPlan,
    page: int,
    scale: float,
    softcap: float | None,
    window: int | None,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    tiles: jax.Array,
    tables: jax.Array,
) -> jax.Array:
    from ejkernel_triton import _prefill_kernels as kern
    from ejkernel_triton import launch

    t, h, d = q.shape
    kh, dv = k.shape[-2], v.shape[-1]
    (o,) = launch.launch(
        kern.ragged_prefill,
        q,
        k,
        v,
        tiles,
        tables,
        float(scale),
        float(softcap) if softcap is not None else 1.0,
        int(window) if window is not None else 0,
        int(tables.shape[1]),
        int(k.shape[0]),
        int(tables.shape[1]) * page,
        out_shape=(jax.ShapeDtypeStruct((t, h, dv), q.dtype),),
        grid=(int(tiles.shape[0]), kh),
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
        name="ejkernel_ragged_prefill",
        H=h,
        KH=kh,
        D=d,
        DV=dv,
        BLOCK_D=_pow2(d),
        BLOCK_DV=_pow2(dv),
        BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n,
        PAGE=page,
        HAS_SOFTCAP=softcap is not None,
        HAS_WINDOW=window is not None,
    )
    return o


def ragged_page_attention(
    query: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array | int,
    *,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    k_scale: Any = None,
    v_scale: Any = None,
    fwd_params: RaggedPageParams | PagedDecodeParams | None = None,
    bwd_params: ForwardOnly | None = None,
) -> jax.Array:
    """Mixed prefill and decode over a paged cache (contract: ``ejkernel.modules.operations.ragged_page_attention``).

    Shapes: ``query [T, H, D]``, ``key_cache [P, page, K, D]``, ``value_cache [P, page, K, Dv]``, ``kv_lens [S]``,
    ``block_tables [S, M]``, ``cu_q_lens [S+1]``; returns ``[T, H, Dv]`` in ``query``'s dtype."""
    query, key_cache, value_cache = refuse_gradients(OP, query, key_cache, value_cache)
    query, softmax_scale, finish = fold_cache_scales(query, k_scale, v_scale, softmax_scale)
    t, h, d = query.shape
    page, kh = int(key_cache.shape[1]), int(key_cache.shape[2])
    slots, dv = int(kv_lens.shape[0]), int(value_cache.shape[-1])
    capacity = int(block_tables.shape[1]) * page
    if t == 0 or slots == 0:
        return jnp.zeros((t, h, dv), query.dtype)
    e, g = int(np.dtype(query.dtype).itemsize), h // kh
    p = _as_params(fwd_params)
    scale = float(d**-0.5 if softmax_scale is None else softmax_scale)
    softcap = None if logits_soft_cap is None else float(logits_soft_cap)
    window = None if sliding_window is None else int(sliding_window)

    cu = _offsets(t, slots, cu_q_lens, num_seqs)
    kv = jnp.clip(jnp.asarray(kv_lens).astype(jnp.int32), 0, _MAX_POSITION)
    tables = jnp.asarray(block_tables).astype(jnp.int32)
    q_len = cu[1:] - cu[:-1]
    is_decode = (q_len >= 1) & (q_len <= DECODE_MAX_Q)

    # Decode: slot s is sequence s's one row (position kv_len - 1), an empty interval for the other slots.
    hi = jnp.where(is_decode, jnp.minimum(kv, capacity), 0)
    lo = jnp.zeros_like(hi) if window is None else jnp.maximum(hi - window, 0)
    plan = _plan(slots, kh, capacity, d, dv, int(np.dtype(key_cache.dtype).itemsize), page, p)
    dec = decode(
        plan,
        query[jnp.minimum(cu[:-1], t - 1)],
        key_cache,
        value_cache,
        lo,
        hi,
        tables,
        page=page,
        scale=scale,
        softcap=softcap,
    )  # [S, H, Dv]

    # Prefill: query tiles of the longer sequences.
    pplan = _prefill_plan(t, g, d, dv, e, p)
    block_q = pplan.block_m // g
    tiles = _tiles(t, t // block_q + slots, block_q, cu, kv)
    run = functools.partial(_launch_prefill, pplan, page, scale, softcap, window)
    pre = run(query, key_cache, value_cache, tiles, tables)  # [T, H, Dv]: the rows of the tiles

    rows = jnp.arange(t, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu[1:], rows, side="right", method="compare_all").astype(jnp.int32), 0, slots - 1)
    live = (rows >= cu[0]) & (rows < cu[slots])
    from_decode = (live & is_decode[seq])[:, None, None]
    from_prefill = (live & ~is_decode[seq])[:, None, None]
    return finish(jnp.where(from_decode, dec[seq], jnp.where(from_prefill, pre, jnp.zeros((), query.dtype))))
