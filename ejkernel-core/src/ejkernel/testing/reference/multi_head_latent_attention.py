"""Reference ``multi_head_latent_attention``: dense, in float32 (float64 where enabled), written to be read."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.device import cdiv
from ejkernel.modules.operations.multi_head_latent_attention import resolve_latent_dim


def gather_pages(kv_cache: jax.Array, block_tables: jax.Array, cache_seqlens: jax.Array) -> jax.Array:
    """The keys of every batch as a dense ``[B, maxp * page, D]``: page ``p`` of batch ``b`` is
    ``kv_cache[block_tables[b, p]]``. Pages past ``ceil(cache_seqlens[b] / page)`` are not read (page 0
    stands in for them; their keys are masked out anyway)."""
    page = kv_cache.shape[1]
    b, maxp = block_tables.shape
    pages_used = cdiv(cache_seqlens[:, None], page)
    tables = jnp.where(jnp.arange(maxp)[None, :] < pages_used, block_tables, 0)
    return kv_cache[tables].reshape(b, maxp * page, kv_cache.shape[-1])


def multi_head_latent_attention(
    query: jax.Array,
    kv: jax.Array,
    *,
    latent_dim: int | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    block_tables: jax.Array | None = None,
    cache_seqlens: jax.Array | None = None,
) -> Any:
    """Dense MLA: every head attends the shared latent ``kv`` (key: all ``D`` dims, value: the first ``Dl``).

    Returns ``[B, T, H, Dl]`` in ``query.dtype``; rows with no admitted key are zeros.

    >>> import jax.numpy as jnp
    >>> q = jnp.zeros((1, 1, 2, 3)); kv = jnp.arange(6.0).reshape(1, 2, 3)
    >>> multi_head_latent_attention(q, kv, latent_dim=2)[0, 0].tolist()  # equal scores: the mean of kv[..., :2]
    [[1.5, 2.5], [1.5, 2.5]]
    """
    b, t, h, d = query.shape
    dl = resolve_latent_dim(latent_dim, d)
    acc = jnp.promote_types(jnp.float32, query.dtype)
    if block_tables is None:
        keys = kv  # [B, S, D]
        lengths = jnp.full((b,), kv.shape[1])
    else:
        assert cache_seqlens is not None, "the paged variant needs both block_tables and cache_seqlens"
        keys = gather_pages(kv, block_tables, cache_seqlens)  # [B, maxp * page, D]
        lengths = cache_seqlens
    keys = keys.astype(acc)
    values = keys[..., :dl]
    s = keys.shape[1]
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    scores = jnp.einsum("bthd,bsd->bhts", query.astype(acc), keys, precision="highest") * scale
    i = jnp.arange(t)[None, :, None]
    j = jnp.arange(s)[None, None, :]
    length = lengths[:, None, None]
    allowed = j < length  # [B, T, S]
    if causal:
        allowed &= j <= i + length - t  # bottom-right aligned on each batch's own length
    allowed = allowed[:, None]  # [B, 1, T, S]: the same for every head
    scores = jnp.where(allowed, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True, initial=-jnp.inf)  # S may be 0
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.where(allowed, jnp.exp(scores - row_max), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0, 1.0, denom)
    return jnp.einsum("bhts,bsl->bthl", p, values, precision="highest").astype(query.dtype)
