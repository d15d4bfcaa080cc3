"""Plain XLA mean pooling: a float32 reduction over T, or a sorted ``segment_sum`` over packed sequences.

Both are one pass over ``x`` (XLA fuses the float32 conversion into the reduction, so no float32 copy of
``x`` is made) and their gradients, by autodiff, are a broadcast or a gather of ``d out``: ``O(T D)``.
There is nothing to tile, so there are no launch parameters (``NoParams``: a config that sets one is
refused).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def mean_pooling(x, *, cu_seqlens=None, fwd_params=None, bwd_params=None):  # fmt: skip
    """Mean over time (contract: ``ejkernel.modules.operations.mean_pooling``)."""
    return _mean_pooling(x, cu_seqlens)


@jax.jit
def _mean_pooling(x: jax.Array, cu_seqlens: jax.Array | None) -> jax.Array:
    t = x.shape[1]
    if cu_seqlens is None:
        return (jnp.sum(x, axis=1, dtype=F32) / max(t, 1)).astype(x.dtype)
    n = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.astype(jnp.int32)
    pos = jnp.arange(t)
    # Sequence of every token, sorted; tokens before cu[0] get -1 and tokens from cu[N] on get N, which
    # segment_sum drops.
    seq = jnp.searchsorted(cu, pos, side="right") - 1
    sums = jax.ops.segment_sum(x[0].astype(F32), seq, num_segments=n, indices_are_sorted=True)
    counts = jnp.maximum(cu[1:] - cu[:-1], 1).astype(F32)
    return (sums / counts[:, None]).astype(x.dtype)


__all__ = ["mean_pooling"]
