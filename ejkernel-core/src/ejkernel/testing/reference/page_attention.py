"""Reference ``page_attention``: gather every sequence's pages into a dense ``[N, M * page]`` cache, then attend.

Also ``masked_attention`` and ``dense_pages``, which the other serving references share.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def dense_pages(cache: jax.Array, block_tables: jax.Array) -> jax.Array:
    """``[P, page, K, E]`` pages, ``[N, M]`` tables -> ``[N, M * page, K, E]``: sequence ``n``'s tokens in order.

    Table entries out of ``[0, P)`` read some page; the callers mask the tokens past each sequence's length.
    """
    n, m = block_tables.shape
    pages = jnp.clip(block_tables, 0, cache.shape[0] - 1)
    return cache[pages].reshape(n, m * cache.shape[1], *cache.shape[2:])


def dequantized(cache: jax.Array, scale: Any, acc: Any = jnp.float32) -> jax.Array:
    """``scale * cache`` in ``acc`` (``cache [..., K, E]``; ``scale``: None, a float, or ``[]``/``[K]`` per kv head)."""
    out = cache.astype(acc)
    if scale is None:
        return out
    return out * jnp.asarray(scale, acc)[..., None]


def masked_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    allowed: jax.Array,
    *,
    softmax_scale: float | None,
    logits_soft_cap: float | None,
) -> jax.Array:
    """One query per row: ``query [R, H, D]``, ``key [R, L, K, D]``, ``value [R, L, K, Dv]``, ``allowed [R, L]``.

    Scores, soft cap, softmax over the allowed keys and the weighted sum of the values, all in float32
    (float64 under x64); disallowed keys and values are replaced by zeros first, so that whatever they
    hold (NaN) cannot leak. A row that allows no key gives zeros. Returns ``[R, H, Dv]`` in ``query.dtype``.
    """
    h, d = query.shape[1], query.shape[2]
    kh = key.shape[2]
    acc = jnp.promote_types(jnp.float32, query.dtype)
    keep = allowed[:, :, None, None]
    q = query.astype(acc)
    k = jnp.repeat(jnp.where(keep, key.astype(acc), 0), h // kh, axis=2)  # GQA: head h reads kv head h // (H // K)
    v = jnp.repeat(jnp.where(keep, value.astype(acc), 0), h // kh, axis=2)
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    scores = jnp.einsum("rhd,rlhd->rhl", q, k, precision="highest") * scale
    if logits_soft_cap is not None:
        scores = logits_soft_cap * jnp.tanh(scores / logits_soft_cap)
    mask = allowed[:, None, :]
    scores = jnp.where(mask, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.where(mask, jnp.exp(scores - row_max), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0, 1.0, denom)
    return jnp.einsum("rhl,rlhd->rhd", p, v, precision="highest").astype(query.dtype)


def page_attention(
    query: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    context_lens: jax.Array,
    block_tables: jax.Array,
    *,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    k_scale: Any = None,
    v_scale: Any = None,
) -> Any:
    """Dense ``page_attention`` (contract: ``ejkernel.modules.operations.page_attention``), computed in float32.

    >>> import jax.numpy as jnp
    >>> q = jnp.zeros((1, 1, 4))
    >>> k = jnp.zeros((3, 2, 1, 4)); v = jnp.arange(24.0).reshape(3, 2, 1, 4)
    >>> # the sequence's 4 tokens are pages 2 and 0 (rows 0, 1 each); equal scores: the mean of their values
    >>> page_attention(q, k, v, jnp.array([4]), jnp.array([[2, 0]]))[0, 0].tolist()
    [10.0, 11.0, 12.0, 13.0]
    """
    lens = context_lens.astype(jnp.int32)
    acc = jnp.promote_types(jnp.float32, query.dtype)
    keys = dequantized(dense_pages(key_cache, block_tables), k_scale, acc)  # [N, M * page, K, D]
    values = dequantized(dense_pages(value_cache, block_tables), v_scale, acc)
    j = jnp.arange(keys.shape[1])[None, :]
    allowed = j < lens[:, None]  # the query sits at position L - 1
    if sliding_window is not None:
        allowed &= j >= lens[:, None] - sliding_window
    return masked_attention(query, keys, values, allowed, softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap)
