"""Mosaic TPU ``ragged_page_attention``: a schedule of (sequence, query tile) work items, built in the wrapper,
run by the shared paged kernel (``tpu._paged``).

Why a schedule. A query tile of ``R`` consecutive rows of the packed ``[T, H, D]`` query may span several
sequences, each with its own page table, length and causal offset. Rather than handle that inside the
kernel, the wrapper cuts every live sequence's rows into items of at most ``R`` rows (item ``i`` is chunk
``i - first[s]`` of the sequence ``s`` with ``first[s] <= i < first[s + 1]``), so that an item never
crosses a sequence: the kernel sees one page table, one causal offset and one key range per grid step.
There are at most ``min(T, (T + S * (R - 1)) // R)`` items (each sequence adds at most one partial
item): that static bound is the grid's first axis, and the items past the real ones have no row (no work,
no fetch). The schedule is ``jnp`` on the ``[S]``-sized arrays, the gathers below are ``[T, H, D]``-sized:
small next to the cache the kernel reads.

Layout. The query rows of every item are gathered into ``[I, R, H, D]`` and laid out as ``[I, K, R * G, D]``
(tile ``g``: kv head ``g``'s ``G`` query heads for each of the ``R`` rows), the kernel's output likewise;
every row then picks its item's result back, and rows no live sequence owns (padding) are zeros.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.device import cdiv

from ejkernel_pallas.tpu._paged import I32, Geometry, Items, paged_attention

BIG = jnp.iinfo(jnp.int32).max


def num_items(t: int, s: int, r: int) -> int:
    """The static bound on the items of ``t`` query rows over ``s`` sequence slots, ``r`` rows per item."""
    return max(1, min(t, (t + s * (r - 1)) // r))


@dataclasses.dataclass
class Plan:
    """The items, the query rows each gathers (``q_rows [I, R]``) and what it takes to put rows back."""

    items: Items
    q_rows: jax.Array
    live: jax.Array  # [S] bool: slot s < num_seqs
    q_start: jax.Array  # [S] first row of every sequence
    q_len: jax.Array  # [S] rows of every live sequence (0 for the others)
    item_first: jax.Array  # [S] the first item of every sequence


def plan(cu_q_lens: jax.Array, kv_lens: jax.Array, num_seqs: Any, t: int, r: int) -> Plan:
    """Items of at most ``r`` rows of one live sequence each, in order of sequence then row."""
    s = kv_lens.shape[0]
    n = jnp.minimum(jnp.asarray(num_seqs, I32).reshape(-1)[0], s)
    live = jnp.arange(s, dtype=I32) < n
    cu = cu_q_lens.astype(I32)
    q_start = cu[:-1]
    q_len = jnp.where(live, jnp.maximum(cu[1:] - q_start, 0), 0)
    kv = kv_lens.astype(I32)
    per_seq = cdiv(q_len, r)
    item_end = jnp.cumsum(per_seq).astype(I32)
    item_first = item_end - per_seq

    i = jnp.arange(num_items(t, s, r), dtype=I32)
    seq = jnp.minimum(jnp.searchsorted(item_end, i, side="right").astype(I32), s - 1)
    real = i < item_end[-1]
    row0 = (i - item_first[seq]) * r  # the item's first row within its sequence
    rows = jnp.where(real, jnp.clip(q_len[seq] - row0, 0, r), 0)
    kv_len = jnp.where(real, kv[seq], 0)
    items = Items(
        pos=kv_len - q_len[seq] + row0,  # the queries are the last q_len tokens of the context
        rows=rows,
        lo=jnp.zeros_like(i),
        hi=kv_len,
        seq=seq,
    )
    q_rows = jnp.clip(q_start[seq][:, None] + row0[:, None] + jnp.arange(r, dtype=I32)[None, :], 0, t - 1)
    return Plan(items, q_rows, live, q_start, q_len, item_first)


def forward(
    geo: Geometry,
    query: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: Any,
    interpret: Any,
) -> jax.Array:
    """``[T, H, Dv]`` in ``query.dtype``."""
    t, h, d = query.shape
    num_pages, page = key_cache.shape[:2]
    dv = value_cache.shape[-1]
    kh, g, r = geo.kv_heads, geo.group, geo.rows
    tables = jnp.clip(block_tables.astype(I32), 0, num_pages - 1)  # entries never read may hold anything
    p = plan(cu_q_lens, kv_lens, num_seqs, t, r)
    schedule = p.items.schedule(geo.bk, geo.window, page, tables.shape[1])
    n_items = p.q_rows.shape[0]
    q = query[p.q_rows].reshape(n_items, r, kh, g, d).transpose(0, 2, 1, 3, 4).reshape(n_items, kh, r * g, d)
    out = paged_attention(geo, schedule, tables, q, key_cache, value_cache, interpret)
    out = out.reshape(n_items, kh, r, g, dv).transpose(0, 2, 1, 3, 4).reshape(n_items * r, h, dv)

    u = jnp.arange(t, dtype=I32)
    ends = jnp.where(p.live, p.q_start + p.q_len, BIG)
    owner = jnp.minimum(jnp.searchsorted(ends, u, side="right").astype(I32), ends.shape[0] - 1)
    within = u - p.q_start[owner]
    owned = p.live[owner] & (within >= 0) & (within < p.q_len[owner])
    flat = jnp.clip((p.item_first[owner] + within // r) * r + within % r, 0, n_items * r - 1)
    return jnp.where(owned[:, None, None], out[flat], jnp.zeros((), out.dtype))
