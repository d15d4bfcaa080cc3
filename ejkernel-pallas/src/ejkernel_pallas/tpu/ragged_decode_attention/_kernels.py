"""Mosaic TPU ``ragged_decode_attention``: one work item per batch row, run by the shared kernel (``tpu._paged``)
over key blocks of the dense cache.

Row ``b`` reads the keys ``[lo, hi)`` (``sequence_start``/``sequence_end`` clipped to ``[0, S]``) with its
query at position ``hi - 1``; an empty range is an item with no real row (zeros). Key blocks are
``(bk, K, D)`` slices of ``key[b]`` (``bk`` consecutive positions, every kv head): a block spec indexed by
``(b, block)``, clamped to the blocks the range (and window) touches, so that the blocks outside cost
neither a fetch nor compute. The last block may reach past ``S``: the positions there are masked.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ejkernel_pallas.tpu._paged import I32, Geometry, Items, dense_attention


def range_items(sequence_start: jax.Array, sequence_end: jax.Array, s: int) -> Items:
    """One item per batch row: its single row at position ``hi - 1``, keys ``[lo, hi)``."""
    hi = jnp.clip(sequence_end.astype(I32), 0, s)
    lo = jnp.clip(sequence_start.astype(I32), 0, s)
    b = hi.shape[0]
    return Items(pos=hi - 1, rows=(hi > lo).astype(I32), lo=lo, hi=hi, seq=jnp.arange(b, dtype=I32))


def forward(
    geo: Geometry,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    sequence_start: jax.Array,
    sequence_end: jax.Array,
    interpret: Any,
) -> jax.Array:
    """``[B, H, Dv]`` in ``query.dtype``."""
    b, h, d = query.shape
    s, dv = key.shape[1], value.shape[-1]
    schedule = range_items(sequence_start, sequence_end, s).schedule(geo.bk, geo.window, 1, 1)
    q = query.reshape(b, geo.kv_heads, geo.group, d)
    return dense_attention(geo, schedule, q, key, value, interpret).reshape(b, h, dv)
