"""Reference ``attention``: dense, float32 (float64 under x64), the attention weights written out."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.kernels.signatures._attention import attention_allowed, dropout_keep


def attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    *,
    attention_mask: jax.Array | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    dropout_prob: float = 0.0,
    dropout_seed: Any = None,
    return_weights: bool = False,
) -> Any:
    """Dense attention (contract: ``ejkernel.modules.operations.attention``).

    Returns ``out [B, T, H, Dv]`` in ``query.dtype``, or ``(out, weights)`` with ``return_weights``:
    ``weights [B, H, T, S]`` the matrix that multiplies ``value`` (after dropout), in float32 (float64
    under x64).

    >>> import jax.numpy as jnp
    >>> q = jnp.zeros((1, 1, 1, 4)); k = jnp.zeros((1, 2, 1, 4)); v = jnp.arange(8.0).reshape(1, 2, 1, 4)
    >>> out, weights = attention(q, k, v, return_weights=True)
    >>> out[0, 0, 0].tolist(), weights[0, 0, 0].tolist()  # equal scores: the mean of the two values
    ([2.0, 3.0, 4.0, 5.0], [0.5, 0.5])
    """
    b, t, h, d = query.shape
    s, kh = key.shape[1], key.shape[2]
    acc = jnp.promote_types(jnp.float32, query.dtype)
    q = query.astype(acc)
    k = jnp.repeat(key.astype(acc), h // kh, axis=2)  # query head h reads kv head h // (H // K)
    v = jnp.repeat(value.astype(acc), h // kh, axis=2)
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    scores = jnp.einsum("bthd,bshd->bhts", q, k, precision="highest") * scale
    if bias is not None:
        scores = scores + bias.astype(acc)
    if logits_soft_cap is not None:
        scores = logits_soft_cap * jnp.tanh(scores / logits_soft_cap)
    allowed = attention_allowed(t, s, causal=causal, sliding_window=sliding_window)[None, None]
    if attention_mask is not None:
        allowed = allowed & attention_mask
    allowed = jnp.broadcast_to(allowed, scores.shape)
    # Softmax over the admitted keys; a row that admits none is all zeros.
    scores = jnp.where(allowed, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.where(allowed, jnp.exp(scores - row_max), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    weights = p / jnp.where(denom == 0, 1.0, denom)
    if dropout_prob > 0:
        bi, hi, ti, si = (
            jnp.arange(n).reshape([-1 if a == ax else 1 for a in range(4)]) for ax, n in enumerate((b, h, t, s))
        )
        keep = dropout_keep(dropout_seed, bi, hi, ti, si, h, dropout_prob, xp=jnp)
        weights = jnp.where(keep, weights / (1.0 - dropout_prob), 0.0)
    out = jnp.einsum("bhts,bshd->bthd", weights, v, precision="highest").astype(query.dtype)
    return (out, weights) if return_weights else out
