"""Reference ``ragged_page_attention``: find every query row's sequence and position, then attend its dense pages."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.testing.reference.page_attention import dense_pages, dequantized, masked_attention


def ragged_page_attention(
    query: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: Any,
    *,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    k_scale: Any = None,
    v_scale: Any = None,
) -> Any:
    """Dense ``ragged_page_attention`` (contract: ``ejkernel.modules.operations.ragged_page_attention``), in float32.

    >>> import jax.numpy as jnp
    >>> q = jnp.zeros((3, 1, 4)); k = jnp.zeros((2, 2, 1, 4)); v = jnp.arange(16.0).reshape(2, 2, 1, 4)
    >>> # one sequence of 3 tokens on pages 0, 1; its last 2 are queries (rows 0, 1), row 2 is padding
    >>> out = ragged_page_attention(q, k, v, jnp.array([3]), jnp.array([[0, 1]]), jnp.array([0, 2]), jnp.array([1]))
    >>> out[:, 0, 0].tolist()  # row 0 (position 1) averages tokens 0, 1; row 1 (position 2) tokens 0, 1, 2
    [2.0, 4.0, 0.0]
    """
    # NumPy arrays too: the rows below index them with traced values.
    query, key_cache, value_cache, kv_lens, block_tables, cu_q_lens = (
        jnp.asarray(x) for x in (query, key_cache, value_cache, kv_lens, block_tables, cu_q_lens)
    )
    t = query.shape[0]
    s_max = kv_lens.shape[0]
    n = jnp.minimum(jnp.asarray(num_seqs, jnp.int32).reshape(-1)[0], s_max)
    cu = cu_q_lens.astype(jnp.int32)
    kv = kv_lens.astype(jnp.int32)
    starts, ends = cu[:-1], cu[1:]
    # owner[t, s]: row t is one of live sequence s's queries.
    rows = jnp.arange(t)[:, None]
    owner = (rows >= starts[None]) & (rows < ends[None]) & (jnp.arange(s_max) < n)[None]
    owned = owner.any(axis=1)
    seq = jnp.argmax(owner, axis=1)
    position = kv[seq] - (ends[seq] - starts[seq]) + (jnp.arange(t) - starts[seq])  # [T]
    acc = jnp.promote_types(jnp.float32, query.dtype)
    keys = dequantized(dense_pages(key_cache, block_tables), k_scale, acc)  # [S, M * page, K, D]: in token order
    values = dequantized(dense_pages(value_cache, block_tables), v_scale, acc)
    j = jnp.arange(keys.shape[1])

    def row(x: Any) -> jax.Array:
        q, s, i, ok = x  # one query row: [H, D], its sequence, position, whether it is a query at all
        allowed = ok & (j <= i) & (j < kv[s])
        if sliding_window is not None:
            allowed &= j > i - sliding_window
        out = masked_attention(
            q[None], keys[s][None], values[s][None], allowed[None],
            softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap,
        )  # fmt: skip
        return out[0]

    # Each row's keys, repeated over the query heads in float32, are O(context * H * D): all rows at once when that
    # is small (the test shapes; no loop to compile), else a few rows at a time.
    xs = (query, seq, position, owned)
    if t * keys.shape[1] * query.shape[1] * keys.shape[-1] <= 1 << 24:
        return jax.vmap(row)(xs)
    return jax.lax.map(row, xs, batch_size=16)
