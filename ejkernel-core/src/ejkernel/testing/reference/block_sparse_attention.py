"""Reference ``block_sparse_attention``: the block mask expanded to tokens, then dense masked attention."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.modules.operations.block_sparse_attention import block_sparse_mask
from ejkernel.testing.reference.flash_attention import flash_attention


def block_sparse_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    block_mask: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    q_block: int = 64,
    kv_block: int = 64,
    local_blocks: int | tuple[int, int] | None = None,
    global_blocks: int = 0,
    causal: bool = False,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
) -> Any:
    """Dense attention under the token mask that ``block_mask`` (or the patterns) and ``causal`` give, in float32.

    Returns ``[B, T, H, Dv]`` in ``query.dtype``; rows without an admitted key are zeros.

    >>> import jax.numpy as jnp
    >>> q = jnp.zeros((1, 2, 1, 4)); k = jnp.zeros((1, 4, 1, 4)); v = jnp.arange(16.0).reshape(1, 4, 1, 4)
    >>> mask = jnp.array([[True, False], [False, True]])[None, None]  # query block i sees key block i
    >>> block_sparse_attention(q, k, v, block_mask=mask, q_block=1, kv_block=2)[0, :, 0].tolist()
    [[2.0, 3.0, 4.0, 5.0], [10.0, 11.0, 12.0, 13.0]]
    """
    t, s = query.shape[1], key.shape[1]
    if block_mask is None:
        pattern = block_sparse_mask(
            t,
            s,
            q_block=q_block,
            kv_block=kv_block,
            local_blocks=local_blocks,
            global_blocks=global_blocks,
            causal=causal,
        )
        block_mask = jnp.asarray(pattern)[None, None]
    # Block (qb, kb) covers queries [qb * q_block, (qb + 1) * q_block) and keys [kb * kv_block, (kb + 1) * kv_block).
    token_mask = jnp.repeat(jnp.repeat(block_mask, q_block, axis=2), kv_block, axis=3)[:, :, :t, :s]
    return flash_attention(
        query,
        key,
        value,
        attention_mask=token_mask,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        softmax_scale=softmax_scale,
        causal=causal,
        logits_soft_cap=logits_soft_cap,
    )
