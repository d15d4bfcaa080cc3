"""Reference ``ragged_page_attention``: find every query row's sequence and position, then attend its dense pages."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.testing.reference.page_attention import dense_pages, masked_attention


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
) -> Any:
    """Dense ``ragged_page_attention`` (contract: ``ejkernel.modules.operations.ragged_page_attention``), in float32.

    >>> import jax.numpy as jnp
    >>> q = jnp.zeros((3, 1, 4)); k = jnp.zeros((2, 2, 1, 4)); v = jnp.arange(16.0).reshape(2, 2, 1, 4)
    >>> # one sequence of 3 tokens on pages 0, 1; its last 2 are queries (rows 0, 1), row 2 is padding
    >>> out = ragged_page_attention(q, k, v, jnp.array([3]), jnp.array([[0, 1]]), jnp.array([0, 2]), jnp.array([1]))
    >>> out[:, 0, 0].tolist()  # row 0 (position 1) averages tokens 0, 1; row 1 (position 2) tokens 0, 1, 2
    [2.0, 4.0, 0.0]
    """
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
    keys = dense_pages(key_cache, block_tables)[seq]  # [T, M * page, K, D]: each row's own sequence
    values = dense_pages(value_cache, block_tables)[seq]
    j = jnp.arange(keys.shape[1])[None, :]
    allowed = owned[:, None] & (j <= position[:, None]) & (j < kv[seq][:, None])
    if sliding_window is not None:
        allowed &= j > position[:, None] - sliding_window
    return masked_attention(query, keys, values, allowed, softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap)
