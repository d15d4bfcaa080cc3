"""Reference implementations: dense, float32 (float64 where enabled), written to be read, not to be fast.

They are the truth every backend is checked against, and depend on no backend.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.kernels.signatures._attention import attention_allowed, dropout_keep


def flash_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    *,
    attention_mask: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    dropout_prob: float = 0.0,
    dropout_seed: Any = None,
    cu_seqlens_q: jax.Array | None = None,
    cu_seqlens_k: jax.Array | None = None,
    kv_lengths: jax.Array | None = None,
    prefix_lengths: jax.Array | None = None,
    return_lse: bool = False,
) -> Any:
    """Dense attention with every option of ``ejkernel.kernels`` ``flash_attention``, computed in float32.

    Returns the output ``[B, T, H, Dv]`` in ``query.dtype`` (and the log-sum-exp ``[B, H, T]``
    in float32, ``-inf`` on fully masked rows, when ``return_lse``).

    >>> import jax.numpy as jnp
    >>> q = k = jnp.zeros((1, 1, 1, 4)); v = jnp.arange(8.0).reshape(1, 2, 1, 4)
    >>> k = jnp.zeros((1, 2, 1, 4))
    >>> flash_attention(q, k, v)[0, 0, 0].tolist()  # equal scores: the mean of the two values
    [2.0, 3.0, 4.0, 5.0]
    """
    b, t, h, d = query.shape
    s, kh = key.shape[1], key.shape[2]
    acc = jnp.promote_types(jnp.float32, query.dtype)
    q = query.astype(acc)
    k = jnp.repeat(key.astype(acc), h // kh, axis=2)
    v = jnp.repeat(value.astype(acc), h // kh, axis=2)
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    scores = jnp.einsum("bthd,bshd->bhts", q, k, precision="highest") * scale
    if bias is not None:
        scores = scores + bias.astype(acc)
    if logits_soft_cap is not None:
        scores = logits_soft_cap * jnp.tanh(scores / logits_soft_cap)
    allowed = attention_allowed(
        t,
        s,
        causal=causal,
        sliding_window=sliding_window,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        kv_lengths=kv_lengths,
        prefix_lengths=prefix_lengths,
    )
    allowed = allowed[:, None] if allowed.ndim == 3 else allowed[None, None]
    if attention_mask is not None:
        allowed = allowed & attention_mask
    if q_segment_ids is not None:
        allowed = allowed & (q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :])
    allowed = jnp.broadcast_to(allowed, scores.shape)
    scores = jnp.where(allowed, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.where(allowed, jnp.exp(scores - row_max), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0, 1.0, denom)
    lse = jnp.where(
        denom[..., 0] > 0, jnp.log(jnp.where(denom[..., 0] > 0, denom[..., 0], 1.0)) + row_max[..., 0], -jnp.inf
    )
    if dropout_prob > 0:
        bi, hi, ti, si = (
            jnp.arange(n).reshape([-1 if a == ax else 1 for a in range(4)]) for ax, n in enumerate((b, h, t, s))
        )
        keep = dropout_keep(dropout_seed, bi, hi, ti, si, h, dropout_prob, xp=jnp)
        p = jnp.where(keep, p / (1.0 - dropout_prob), 0.0)
    out = jnp.einsum("bhts,bshd->bthd", p, v, precision="highest").astype(query.dtype)
    return (out, lse) if return_lse else out
