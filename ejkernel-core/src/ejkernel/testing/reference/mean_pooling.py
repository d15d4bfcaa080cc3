"""Reference ``mean_pooling``: sums and counts through a membership mask, in float32 (float64 where enabled)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def mean_pooling(x: jax.Array, *, cu_seqlens: jax.Array | None = None) -> jax.Array:
    """The mean over time of every batch row ``[B, D]``, or of every packed sequence ``[N, D]``.

    An empty sequence (or T == 0) gives zeros. The result has ``x``'s dtype.

    >>> import jax.numpy as jnp
    >>> x = jnp.arange(8.0).reshape(1, 4, 2)  # rows [0, 1], [2, 3], [4, 5], [6, 7]
    >>> mean_pooling(x).tolist()
    [[3.0, 4.0]]
    >>> mean_pooling(x, cu_seqlens=jnp.array([0, 1, 1, 4])).tolist()  # [0, 1] / nothing / [2..7]
    [[0.0, 1.0], [0.0, 0.0], [4.0, 5.0]]
    """
    acc = jnp.promote_types(jnp.float32, x.dtype)
    b, t, _ = x.shape
    if cu_seqlens is None:
        member = jnp.ones((b, 1, t), acc)  # [B, 1, T]: every token of row b counts for output b
    else:
        pos = jnp.arange(t)
        # member[0, n, t]: token t lies in sequence n
        member = ((pos[None, :] >= cu_seqlens[:-1, None]) & (pos[None, :] < cu_seqlens[1:, None])).astype(acc)[None]
    sums = jnp.einsum("bnt,btd->bnd", member, x.astype(acc), precision="highest")
    counts = jnp.sum(member, axis=-1)[..., None]
    means = sums / jnp.maximum(counts, 1.0)
    return means.reshape(-1, x.shape[-1]).astype(x.dtype)
