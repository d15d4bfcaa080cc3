"""Reference ``native_sparse_attention``: each branch as dense masked attention, summed under the gates."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.testing.reference.flash_attention import flash_attention


def native_sparse_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    block_indices: jax.Array,
    *,
    block_counts: int | jax.Array | None = None,
    g_slc: jax.Array | None = None,
    g_cmp: jax.Array | None = None,
    g_swa: jax.Array | None = None,
    block_size: int = 64,
    window_size: int = 0,
    softmax_scale: float | None = None,
    causal: bool = True,
) -> Any:
    """NSA's selected (+ compressed, + sliding) attention, in float32; returns ``[B, T, H, Dv]`` in ``query.dtype``.

    >>> import jax.numpy as jnp
    >>> q = jnp.zeros((1, 1, 1, 2)); k = jnp.zeros((1, 4, 1, 2)); v = jnp.arange(8.0).reshape(1, 4, 1, 2)
    >>> idx = jnp.array([[[[1, 1, -1]]]])  # block 1 (keys 2, 3), listed twice: it counts once
    >>> native_sparse_attention(q, k, v, idx, block_size=2)[0, 0, 0].tolist()
    [5.0, 6.0]
    """
    t, h = query.shape[1], query.shape[2]
    s, kh = key.shape[1], key.shape[2]
    acc = jnp.promote_types(jnp.float32, query.dtype)
    q, k, v = (x.astype(acc) for x in (query, key, value))
    n_slots = block_indices.shape[-1]
    n_blocks = -(-s // block_size)
    pos = jnp.arange(t) + (s - t)  # the aligned key position of every query

    # Selected: key j is in the set of query i (kv head k) when a used slot names j's block.
    count = n_slots if block_counts is None else block_counts
    used = jnp.arange(n_slots) < jnp.asarray(count)[..., None]  # [B, T, K, N] (or [N])
    key_block = jnp.arange(s) // block_size
    selected = jnp.any(used[..., None] & (block_indices[..., None] == key_block), axis=3)  # [B, T, K, S]
    selected = jnp.repeat(selected, h // kh, axis=2).transpose(0, 2, 1, 3)  # [B, H, T, S]
    o_slc = flash_attention(q, k, v, attention_mask=selected, causal=causal, softmax_scale=softmax_scale)
    out = o_slc if g_slc is None else o_slc * g_slc.astype(acc)[..., None]

    if g_cmp is not None:
        padded = n_blocks * block_size
        sizes = jnp.minimum(block_size, s - jnp.arange(n_blocks) * block_size).astype(acc)  # keys per block

        def pool(x: jax.Array) -> jax.Array:
            x = jnp.pad(x, ((0, 0), (0, padded - s), (0, 0), (0, 0)))
            x = x.reshape(x.shape[0], n_blocks, block_size, *x.shape[2:]).sum(axis=2)
            return x / sizes[None, :, None, None]

        complete = (jnp.arange(n_blocks) + 1) * block_size - 1 <= pos[:, None]  # [T, NB]
        allowed = complete if causal else jnp.ones_like(complete)
        o_cmp = flash_attention(q, pool(k), pool(v), attention_mask=allowed[None, None], softmax_scale=softmax_scale)
        out = out + o_cmp * g_cmp.astype(acc)[..., None]

    if window_size > 0:
        assert g_swa is not None  # the contract requires the gate with a window
        window = (window_size - 1, 0) if causal else (window_size - 1, window_size - 1)
        o_swa = flash_attention(q, k, v, causal=causal, sliding_window=window, softmax_scale=softmax_scale)
        out = out + o_swa * g_swa.astype(acc)[..., None]
    return out.astype(query.dtype)
