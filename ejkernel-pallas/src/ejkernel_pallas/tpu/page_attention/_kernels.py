"""Mosaic TPU ``page_attention``: one work item per sequence, run by the shared paged kernel (``tpu._paged``).

Sequence ``n`` with ``L = context_lens[n]`` keys is an item of one query row at position ``L - 1`` that
reads the keys ``[0, L)`` through its page table row; ``L == 0`` is an item with no real row (zeros).
The query ``[N, H, D]`` is viewed as ``[N, K, G, D]`` (a reshape: one ``[G, D]`` tile per kv head).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ejkernel_pallas.tpu._paged import I32, Geometry, Items, paged_attention


def decode_items(context_lens: jax.Array) -> Items:
    """One item per sequence: its single row at position ``L - 1``, keys ``[0, L)``, its own table row."""
    lens = jnp.maximum(context_lens.astype(I32), 0)
    n = lens.shape[0]
    return Items(
        pos=lens - 1, rows=(lens > 0).astype(I32), lo=jnp.zeros((n,), I32), hi=lens, seq=jnp.arange(n, dtype=I32)
    )


def forward(
    geo: Geometry,
    query: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    context_lens: jax.Array,
    block_tables: jax.Array,
    interpret: Any,
) -> jax.Array:
    """``[N, H, Dv]`` in ``query.dtype``."""
    n, h, d = query.shape
    num_pages, page = key_cache.shape[:2]
    dv = value_cache.shape[-1]
    tables = jnp.clip(block_tables.astype(I32), 0, num_pages - 1)  # entries past a length may hold anything
    schedule = decode_items(context_lens).schedule(geo.bk, geo.window, page, tables.shape[1])
    q = query.reshape(n, geo.kv_heads, geo.group, d)
    out = paged_attention(geo, schedule, tables, q, key_cache, value_cache, interpret)
    return out.reshape(n, h, dv)
