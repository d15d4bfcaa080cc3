"""Reference ``ragged_decode_attention``: every batch row attends the keys in its valid range."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.testing.reference.page_attention import dequantized, masked_attention


def ragged_decode_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    sequence_start: jax.Array,
    sequence_end: jax.Array,
    *,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    k_scale: Any = None,
    v_scale: Any = None,
) -> Any:
    """Dense ``ragged_decode_attention`` (contract: ``ejkernel.modules.operations.ragged_decode_attention``), in float32.

    >>> import jax.numpy as jnp
    >>> q = jnp.zeros((2, 1, 4)); k = jnp.zeros((2, 3, 1, 4)); v = jnp.arange(24.0).reshape(2, 3, 1, 4)
    >>> out = ragged_decode_attention(q, k, v, jnp.array([1, 2]), jnp.array([3, 2]))
    >>> out[:, 0, 0].tolist()  # row 0: the mean of keys 1 and 2; row 1: an empty range
    [6.0, 0.0]
    """
    j = jnp.arange(key.shape[1])[None, :]
    end = sequence_end.astype(jnp.int32)[:, None]
    allowed = (j >= sequence_start.astype(jnp.int32)[:, None]) & (j < end)
    if sliding_window is not None:
        allowed &= j >= jnp.minimum(end, key.shape[1]) - sliding_window  # the query sits at position hi - 1
    acc = jnp.promote_types(jnp.float32, query.dtype)
    key, value = dequantized(key, k_scale, acc), dequantized(value, v_scale, acc)
    return masked_attention(query, key, value, allowed, softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap)
