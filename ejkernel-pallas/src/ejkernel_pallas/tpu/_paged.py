"""What the three Mosaic TPU serving kernels share: one attention kernel over key blocks, fed page by page
(``page_attention``, ``ragged_page_attention``) or from a dense cache (``ragged_decode_attention``).

Shapes: I work items, R query rows per item, H query heads, K kv heads, G = H // K, D/Dv head dims,
P pages of ``page`` tokens, ``ppb`` pages per key block, ``bk`` keys per block.

Work items. Every op is cut into items: an item is ``R`` consecutive query rows of one sequence, with
the position of its first row (row ``r`` sits at ``pos + r``), how many of its rows are real and the
valid key range ``[lo, hi)`` of its sequence. Row ``r`` admits the keys ``j`` with ``lo <= j < hi``,
``j <= pos + r`` and, with a window ``W``, ``j > pos + r - W``. A decode query is an item of one row
(``R = 1``); a prefill chunk of ``ragged_page_attention`` an item of ``R`` rows. The wrappers build the
items with ``jnp`` on the (small) length arrays and hand them to the kernel by scalar prefetch (SMEM),
one flat int32 array of ``NF`` fields per item (``FIELDS``), so that index maps and kernels can read them.

Grid ``(I, key blocks)``: items are independent ("parallel", split over a megacore's cores), the key
blocks are the online-softmax reduction ("arbitrary", last). The items' visible key blocks
``[first, end)`` are precomputed; a step outside does no work and its index maps clamp to the nearest
visible block, so the pipeline keeps the resident block instead of fetching one (blocks past the
length or before the window cost neither a DMA nor compute).

Why whole pages, all kv heads. The cache is ``[P, page, K, D]``: a kv head's rows of a page are one
row of each ``(K, D)`` tile, a sub-tile slice. A block spec must cover the last two dims whole (or in
multiples of (8, 128)) and a DMA window must start on a tile, so neither can fetch one head's rows.
Each step therefore fetches whole ``(page, K, D)`` pages (contiguous in HBM) through ``ppb`` block
specs whose index maps read the page table (so the cache is never copied or gathered by XLA), and all
K heads are computed from them: for kv head ``g`` the kernel reads the page's ``[page, D]`` rows of that
head from VMEM (one sublane of every ``(K, D)`` tile: a strided read) and multiplies them with the
``[R * G, D]`` query tile of the ``G`` query heads that share it. Every page is fetched once per item, not
once per head.

Cache entries that no row may read (the rest of a last page, positions outside ``[lo, hi)``) can hold
anything, NaN included: their scores are replaced (``where``, not a multiplication) and their values
zeroed before the ``p @ v`` product, so nothing leaks. Statistics and the accumulator are float32 VMEM
scratch, the statistics replicated over the 128 lanes (the TPU's layout for a per-row value).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ejkernel.device import cdiv, round_up

F32 = jnp.float32
I32 = jnp.int32
LANES = 128
SUPPORTED_DTYPES = ("float32", "bfloat16")

# Per-item fields of the schedule (one flat int32 array in SMEM, NF entries per item).
FIELDS = ("first", "end", "lo", "hi", "pos", "rows", "seq", "last_page")
NF = len(FIELDS)
_F = {name: i for i, name in enumerate(FIELDS)}

# VMEM budgets (bytes): the double-buffered key and value blocks, and the query tile with its float32
# accumulator. Scoped VMEM is 16 MiB by default on v5e (32 MiB on v6e); these leave room for the score tile.
KV_VMEM_BYTES = 8 << 20
Q_VMEM_BYTES = 4 << 20
DEFAULT_KV_TOKENS = 512
MAX_PAGES_PER_BLOCK = 16  # one block spec (one DMA per step) per page: the kernel's code grows with their number


def supports(inv: Any) -> str | None:
    """``None`` when these kernels serve ``inv``, else the reason they do not (the dtypes are all they decline:
    float16, and a float8 cache)."""
    dtype = str(np.dtype(inv.arguments["query"].dtype))
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} (Mosaic TPU kernels take float32 or bfloat16)"
    for name in ("key_cache", "key"):
        cache = inv.arguments.get(name)
        if cache is not None and str(np.dtype(cache.dtype)) != dtype:
            return f"{name} dtype {np.dtype(cache.dtype)}: a float8 cache is not supported (the query is {dtype})"
    return None


def interpret_params() -> Any:
    """TPU interpret mode (on CPU, for tests); races are looked for when ``EJKERNEL_PALLAS_DETECT_RACES=1``."""
    return pltpu.InterpretParams(detect_races=os.environ.get("EJKERNEL_PALLAS_DETECT_RACES") == "1")


def compiler_params(interpret: Any) -> Any:
    if interpret:
        # JAX's TPU interpreter does not extend dimension_semantics by the grid axes that vmap prepends
        # (Mosaic's lowering does), so interpreted kernels leave them unset: every axis sequential.
        return pltpu.CompilerParams()
    return pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))


def kv_row_bytes(kv_heads: int, head_dim: int, dtype: Any) -> int:
    """VMEM bytes of one token of a ``(…, K, D)`` block: K padded to the sublane tile (8 rows of 32 bits)."""
    itemsize = jnp.dtype(dtype).itemsize
    return round_up(kv_heads, 8 * (4 // itemsize)) * round_up(head_dim, LANES) * itemsize


def max_kv_tokens(kv_heads: int, e: int, dtype: Any) -> int:
    """The most keys per block that fit ``KV_VMEM_BYTES`` (keys and values, double-buffered), at least 8."""
    return max(8, KV_VMEM_BYTES // (4 * kv_row_bytes(kv_heads, e, dtype)))


def pages_per_block(wanted_tokens: int | None, page: int, m: int, kv_heads: int, e: int, dtype: Any) -> int:
    """Pages per key block: ``wanted_tokens`` (default ``DEFAULT_KV_TOKENS``) rounded down to whole pages, at
    least one, at most the table's ``m`` columns, ``MAX_PAGES_PER_BLOCK`` and the VMEM budget."""
    tokens = DEFAULT_KV_TOKENS if wanted_tokens is None else int(wanted_tokens)
    most = max(1, min(m, MAX_PAGES_PER_BLOCK, max_kv_tokens(kv_heads, e, dtype) // page))
    return max(1, min(most, tokens // page))


def candidate_pages(page: int, m: int, kv_heads: int, e: int, dtype: Any) -> list[int]:
    """Pages per block worth timing: 64 to 1024 keys (rounded to pages), within the limits above."""
    out: list[int] = []
    for tokens in (64, 128, 256, 512, 1024):
        ppb = pages_per_block(tokens, page, m, kv_heads, e, dtype)
        if ppb not in out:
            out.append(ppb)
    return out


# ---- the schedule --------------------------------------------------------------------------------


@dataclasses.dataclass
class Items:
    """Per-item arrays (``[I]`` int32) before flattening; see the module docstring for their meaning."""

    pos: jax.Array
    rows: jax.Array
    lo: jax.Array
    hi: jax.Array
    seq: jax.Array

    def schedule(self, bk: int, window: int | None, page: int, m: int) -> jax.Array:
        """The flat ``[I * NF]`` schedule: the item's visible key blocks ``[first, end)`` (``0, 0`` when none)
        and, for paged caches, the last table column it reads (clamped to ``[0, m)``)."""
        first_tok = self.lo
        if window is not None:
            first_tok = jnp.maximum(first_tok, self.pos - window + 1)
        end_tok = jnp.minimum(self.pos + self.rows, self.hi)  # the last row's keys end at its own position
        some = (self.rows > 0) & (end_tok > first_tok)
        first = jnp.where(some, first_tok // bk, 0)
        end = jnp.where(some, cdiv(end_tok, bk), 0)
        last_page = jnp.clip(cdiv(jnp.where(some, end_tok, 1), page) - 1, 0, m - 1)
        fields = {
            "first": first, "end": end, "lo": self.lo, "hi": self.hi, "pos": self.pos, "rows": self.rows,
            "seq": self.seq, "last_page": last_page,
        }  # fmt: skip
        return jnp.stack([fields[f].astype(I32) for f in FIELDS], axis=1).reshape(-1)


# ---- the kernel ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Static description of one call."""

    rows: int  # R: query rows per item
    group: int  # G: query heads per kv head
    kv_heads: int  # K
    bk: int  # keys per block
    pages: int  # pages per block (ppb); 0 for a dense cache
    scale: float
    soft_cap: float | None
    window: int | None

    @property
    def tile_rows(self) -> int:
        return self.rows * self.group  # rows of a query tile: R rows x G heads (row-major)


def _attend_kernel(geo: Geometry, n_prefetch: int, *refs: Any) -> None:
    """One (item, key block) step; ``refs``: scalar prefetch, query tile, key refs, value refs, output, scratch.

    Query/output blocks are ``[K, R * G, D]``: tile ``g`` holds the rows of kv head ``g``'s query heads,
    row ``r * G + h`` being query row ``r``, head ``g * G + h``.
    """
    items_ref = refs[0]
    n_kv = max(geo.pages, 1)
    q_ref = refs[n_prefetch]
    k_refs = refs[n_prefetch + 1 : n_prefetch + 1 + n_kv]
    v_refs = refs[n_prefetch + 1 + n_kv : n_prefetch + 1 + 2 * n_kv]
    o_ref, m_sc, l_sc, acc_sc = refs[n_prefetch + 1 + 2 * n_kv :]
    i, j = pl.program_id(0), pl.program_id(1)

    def field(name: str) -> Any:
        return items_ref[i * NF + _F[name]]

    @pl.when(j == 0)
    def _init() -> None:
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, F32)
        l_sc[...] = jnp.zeros(l_sc.shape, F32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, F32)

    @pl.when((j >= field("first")) & (j < field("end")))
    def _step() -> None:
        lo, hi, pos = field("lo"), field("hi"), field("pos")
        shape = (geo.tile_rows, geo.bk)
        row = lax.broadcasted_iota(I32, shape, 0) // geo.group  # the query row of each tile row
        col = j * geo.bk + lax.broadcasted_iota(I32, shape, 1)  # the key position of each column
        q_pos = pos + row
        allowed = (row < field("rows")) & (col >= lo) & (col < hi) & (col <= q_pos)
        if geo.window is not None:
            allowed &= col > q_pos - geo.window
        key_pos = j * geo.bk + lax.broadcasted_iota(I32, (geo.bk, 1), 0)
        key_ok = (key_pos >= lo) & (key_pos < hi)  # [bk, 1]: positions that hold a key of this sequence

        for g in range(geo.kv_heads):  # every kv head from the same resident pages
            if geo.pages:  # the head's rows of each page, stacked in token order
                k = jnp.concatenate([r[:, g, :] for r in k_refs], axis=0) if geo.pages > 1 else k_refs[0][:, g, :]
                v = jnp.concatenate([r[:, g, :] for r in v_refs], axis=0) if geo.pages > 1 else v_refs[0][:, g, :]
            else:
                k, v = k_refs[0][:, g, :], v_refs[0][:, g, :]
            # Values outside [lo, hi) may be NaN: zeroed (selected in float32: packed bfloat16 selects are
            # not on every chip), so that their zero probabilities cannot turn into NaN in p @ v.
            v = jnp.where(key_ok, v.astype(F32), 0.0).astype(v.dtype)
            s = lax.dot_general(q_ref[g], k, (((1,), (1,)), ((), ())), preferred_element_type=F32) * geo.scale
            if geo.soft_cap is not None:
                s = geo.soft_cap * jnp.tanh(s / geo.soft_cap)
            s = jnp.where(allowed, s, -jnp.inf)
            m_prev = m_sc[g][:, :1]
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row with nothing admitted yet stays at 0
            p = jnp.where(allowed, jnp.exp(s - m_safe), 0.0)
            alpha = jnp.exp(m_prev - m_safe)
            l_sc[g] = jnp.broadcast_to(alpha * l_sc[g][:, :1] + jnp.sum(p, axis=1, keepdims=True), l_sc.shape[1:])
            pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=F32)
            acc_sc[g] = alpha * acc_sc[g] + pv
            m_sc[g] = jnp.broadcast_to(m_new, m_sc.shape[1:])

    @pl.when(j == pl.num_programs(1) - 1)
    def _finish() -> None:
        for g in range(geo.kv_heads):
            l = l_sc[g][:, :1]
            has = l > 0
            o_ref[g] = jnp.where(has, acc_sc[g] / jnp.where(has, l, 1.0), 0.0).astype(o_ref.dtype)


def _scratch(geo: Geometry, dv: int) -> list[Any]:
    rg = geo.tile_rows
    return [
        pltpu.VMEM((geo.kv_heads, rg, LANES), F32),  # running max
        pltpu.VMEM((geo.kv_heads, rg, LANES), F32),  # running sum
        pltpu.VMEM((geo.kv_heads, rg, dv), F32),  # accumulator
    ]


def _visible_block(j: Any, items: Any, i: Any) -> Any:
    """Key block ``j`` clamped into the item's visible blocks (an invisible step re-uses a resident block)."""
    first, end = items[i * NF + _F["first"]], items[i * NF + _F["end"]]
    return jnp.minimum(jnp.maximum(j, first), jnp.maximum(end - 1, first))


def _io_specs(geo: Geometry, d: int, dv: int) -> tuple[Any, Any]:
    rg = geo.tile_rows
    q_spec = pl.BlockSpec((None, geo.kv_heads, rg, d), lambda i, j, *_: (i, 0, 0, 0))
    o_spec = pl.BlockSpec((None, geo.kv_heads, rg, dv), lambda i, j, *_: (i, 0, 0, 0))
    return q_spec, o_spec


def paged_attention(
    geo: Geometry,
    schedule: jax.Array,
    tables: jax.Array,
    q: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    interpret: Any,
) -> jax.Array:
    """``[I, K, R * G, Dv]``: items over a paged cache.

    ``schedule [I * NF]`` (``Items.schedule``); ``tables [S, M]`` page tables, entries in ``[0, P)``
    (handed to the kernel flattened: a 2-D SMEM array would pad its rows to 128 entries);
    ``q [I, K, R * G, D]``; caches ``[P, page, K, D|Dv]``.
    """
    n_items, kh, rg, d = q.shape
    _, page, _, dv = value_cache.shape
    cols = int(tables.shape[1])

    def page_spec(slot: int, e: int) -> Any:
        def index(i: Any, j: Any, items: Any, table: Any) -> Any:
            column = jnp.minimum(_visible_block(j, items, i) * geo.pages + slot, items[i * NF + _F["last_page"]])
            return table[items[i * NF + _F["seq"]] * cols + column], 0, 0, 0

        return pl.BlockSpec((None, page, kh, e), index)

    q_spec, o_spec = _io_specs(geo, d, dv)
    in_specs = [q_spec]
    in_specs += [page_spec(p, d) for p in range(geo.pages)]
    in_specs += [page_spec(p, dv) for p in range(geo.pages)]
    return pl.pallas_call(
        functools.partial(_attend_kernel, geo, 2),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(n_items, cdiv(cols, geo.pages)),
            in_specs=in_specs,
            out_specs=o_spec,
            scratch_shapes=_scratch(geo, dv),
        ),
        out_shape=jax.ShapeDtypeStruct((n_items, kh, rg, dv), q.dtype),
        compiler_params=compiler_params(interpret),
        interpret=interpret,
        name="ejkernel_paged_attention",
    )(schedule, tables.reshape(-1), q, *([key_cache] * geo.pages), *([value_cache] * geo.pages))


def dense_attention(
    geo: Geometry, schedule: jax.Array, q: jax.Array, key: jax.Array, value: jax.Array, interpret: Any
) -> jax.Array:
    """``[B, K, G, Dv]``: one item per batch row over a dense cache ``key [B, S, K, D]``, ``value [B, S, K, Dv]``;
    ``q [B, K, G, D]``, ``schedule [B * NF]``."""
    b, kh, rg, d = q.shape
    s, dv = key.shape[1], value.shape[3]

    def kv_index(i: Any, j: Any, items: Any) -> Any:
        return i, _visible_block(j, items, i), 0, 0

    q_spec, o_spec = _io_specs(geo, d, dv)
    return pl.pallas_call(
        functools.partial(_attend_kernel, geo, 1),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, cdiv(s, geo.bk)),
            in_specs=[
                q_spec,
                pl.BlockSpec((None, geo.bk, kh, d), kv_index),
                pl.BlockSpec((None, geo.bk, kh, dv), kv_index),
            ],
            out_specs=o_spec,
            scratch_shapes=_scratch(geo, dv),
        ),
        out_shape=jax.ShapeDtypeStruct((b, kh, rg, dv), q.dtype),
        compiler_params=compiler_params(interpret),
        interpret=interpret,
        name="ejkernel_ragged_decode_attention",
    )(schedule, q, key, value)
