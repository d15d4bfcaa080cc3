"""Reference ``scaled_dot_product_attention``: dense, float32 (float64 under x64), jax's semantics written out."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def scaled_dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
) -> jax.Array:
    """Dense scaled dot-product attention (contract: ``ejkernel.modules.operations.scaled_dot_product_attention``).

    Returns ``[B, T, N, Hv]`` in ``query.dtype``; a query row without any admitted key gives zeros.

    >>> import jax.numpy as jnp
    >>> q = jnp.zeros((1, 2, 1, 4)); k = jnp.zeros((1, 2, 1, 4)); v = jnp.arange(8.0).reshape(1, 2, 1, 4)
    >>> scaled_dot_product_attention(q, k, v, is_causal=True)[0, :, 0].tolist()  # row 0 sees key 0, row 1 both
    [[0.0, 1.0, 2.0, 3.0], [2.0, 3.0, 4.0, 5.0]]
    """
    b, t, n, h = query.shape
    s, kh = key.shape[1], key.shape[2]
    acc = jnp.promote_types(jnp.float32, query.dtype)
    q = query.astype(acc)
    k = jnp.repeat(key.astype(acc), n // kh, axis=2)  # query head n reads kv head n // (N // K)
    v = jnp.repeat(value.astype(acc), n // kh, axis=2)
    scale = h**-0.5 if scale is None else scale
    logits = jnp.einsum("btnh,bsnh->bnts", q, k, precision="highest") * scale
    if bias is not None:
        logits = logits + bias.astype(acc)  # broadcasts along every axis of size 1

    i = jnp.arange(t)[:, None]  # query position
    j = jnp.arange(s)[None, :]  # key position; query i and key i share a position (top-left)
    allowed = jnp.ones((b, n, t, s), bool)
    if mask is not None:
        allowed &= mask
    if is_causal:
        allowed &= j <= i
    if local_window_size is not None:
        left, right = (
            (local_window_size, local_window_size) if isinstance(local_window_size, int) else local_window_size
        )
        allowed &= (i - left <= j) & (j <= i + right)
    if query_seq_lengths is not None:
        allowed &= i < query_seq_lengths[:, None, None, None]
    if key_value_seq_lengths is not None:
        allowed &= j < key_value_seq_lengths[:, None, None, None]

    # Softmax over the admitted keys; a row that admits none is all zeros (jax would average all values).
    logits = jnp.where(allowed, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.where(allowed, jnp.exp(logits - row_max), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0, 1.0, denom)
    return jnp.einsum("bnts,bsnh->btnh", p, v, precision="highest").astype(query.dtype)
