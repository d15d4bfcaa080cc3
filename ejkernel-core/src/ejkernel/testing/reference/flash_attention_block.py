"""Reference ``flash_attention_block`` and ``flash_attention_block_bwd``: dense, float32, written to be read.

The backward is written out (not ``jax.vjp`` of the forward) because it takes the *global* ``out``/``lse``
of the rows, which a block's own forward does not know.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.kernels.signatures._attention import block_allowed


def _scores(
    query: jax.Array,
    key: jax.Array,
    *,
    q_positions: Any,
    kv_positions: Any,
    q_segment_ids: Any,
    kv_segment_ids: Any,
    softmax_scale: float | None,
    causal: bool,
    sliding_window: Any,
    logits_soft_cap: float | None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Scores ``[B, H, T, S]`` (float32, before masking), the mask, and ``tanh`` of the soft cap (or None)."""
    b, t, h, d = query.shape
    s, kh = key.shape[1], key.shape[2]
    acc = jnp.promote_types(jnp.float32, query.dtype)
    q = query.astype(acc)
    k = jnp.repeat(key.astype(acc), h // kh, axis=2)
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    scores = jnp.einsum("bthd,bshd->bhts", q, k, precision="highest") * scale
    tanh = None
    if logits_soft_cap is not None:
        tanh = jnp.tanh(scores / logits_soft_cap)
        scores = logits_soft_cap * tanh
    allowed = block_allowed(q_positions, kv_positions, t, s, causal=causal, sliding_window=sliding_window)[None, None]
    if q_segment_ids is not None:
        allowed = allowed & (q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :])
    return scores, jnp.broadcast_to(allowed, scores.shape), tanh


def flash_attention_block(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    q_positions: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``(out [B, T, H, Dv] float32, lse [B, H, T] float32)`` of the queries against this block's keys.

    >>> import jax.numpy as jnp
    >>> q = jnp.zeros((1, 1, 1, 4)); k = jnp.zeros((1, 2, 1, 4)); v = jnp.arange(8.0).reshape(1, 2, 1, 4)
    >>> out, lse = flash_attention_block(q, k, v)
    >>> out[0, 0, 0].tolist(), round(float(lse[0, 0, 0]), 4)  # equal scores: the mean, lse = log 2
    ([2.0, 3.0, 4.0, 5.0], 0.6931)
    """
    h, kh = query.shape[2], key.shape[2]
    scores, allowed, _ = _scores(
        query, key, q_positions=q_positions, kv_positions=kv_positions, q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids, softmax_scale=softmax_scale, causal=causal, sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
    )  # fmt: skip
    scores = jnp.where(allowed, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.where(allowed, jnp.exp(scores - row_max), 0.0)
    denom = p.sum(axis=-1)
    seen = denom > 0
    lse = jnp.where(seen, jnp.log(jnp.where(seen, denom, 1.0)) + row_max[..., 0], -jnp.inf)
    p = p / jnp.where(seen, denom, 1.0)[..., None]
    v = jnp.repeat(value.astype(p.dtype), h // kh, axis=2)
    out = jnp.einsum("bhts,bshd->bthd", p, v, precision="highest")
    return out.astype(jnp.promote_types(jnp.float32, out.dtype)), lse.astype(jnp.promote_types(jnp.float32, lse.dtype))


def flash_attention_block_bwd(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    out: jax.Array,
    lse: jax.Array,
    dout: jax.Array,
    *,
    dlse: jax.Array | None = None,
    q_positions: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """This block's ``(dq, dk, dv)`` (float32) from the rows' global ``out``/``lse`` and the cotangents.

    ``P = exp(s - lse)`` on the admitted keys, ``dV = P^T dout``, ``dP = dout V^T``,
    ``dS = P (dP - rowsum(dout * out) + dlse)``, times ``1 - tanh^2`` under a soft cap, then
    ``dQ = scale dS K`` and ``dK = scale dS^T Q`` (dK, dV summed over the query heads of each kv head).
    """
    b, t, h, d = query.shape
    s, kh = key.shape[1], key.shape[2]
    g = h // kh
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    scores, allowed, tanh = _scores(
        query, key, q_positions=q_positions, kv_positions=kv_positions, q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids, softmax_scale=softmax_scale, causal=causal, sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
    )  # fmt: skip
    acc = scores.dtype
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0).astype(acc)  # rows without keys: P = 0 anyway
    p = jnp.where(allowed, jnp.exp(scores - lse[..., None]), 0.0)  # [B, H, T, S]
    do, o = dout.astype(acc), out.astype(acc)
    q = query.astype(acc)
    k = jnp.repeat(key.astype(acc), g, axis=2)
    v = jnp.repeat(value.astype(acc), g, axis=2)
    delta = jnp.einsum("bthd,bthd->bht", do, o, precision="highest")
    if dlse is not None:
        delta = delta - dlse.astype(acc)
    dv = jnp.einsum("bhts,bthd->bshd", p, do, precision="highest")
    dp = jnp.einsum("bthd,bshd->bhts", do, v, precision="highest")
    ds = p * (dp - delta[..., None])
    if tanh is not None:
        ds = ds * (1.0 - tanh * tanh)
    dq = jnp.einsum("bhts,bshd->bthd", ds, k, precision="highest") * scale
    dk = jnp.einsum("bhts,bthd->bshd", ds, q, precision="highest") * scale
    dk = dk.reshape(b, s, kh, g, d).sum(axis=3)
    dv = dv.reshape(b, s, kh, g, -1).sum(axis=3)
    return dq, dk, dv
