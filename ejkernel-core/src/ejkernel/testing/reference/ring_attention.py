"""Reference ``ring_attention``: gather the whole sequence, undo the layout, run the flash reference, keep our part."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ejkernel.modules.operations.ring_attention import layout_permutation, ring_axis_size
from ejkernel.testing.reference.flash_attention import flash_attention


def ring_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    axis_name: str | None = None,
    layout: str = "contiguous",
) -> Any:
    """Dense ``ring_attention``: this device's rows of the flash reference on the gathered sequence.

    Every array is gathered along ``axis_name`` (``lax.all_gather``), put back in natural order
    (the inverse of ``layout``), attended densely by ``flash_attention``'s reference, and the output
    is laid out again and sliced to this device's queries. With ``axis_name=None``: the flash
    reference on the local sequence.

    >>> import jax.numpy as jnp
    >>> q = jnp.zeros((1, 2, 1, 4)); k = jnp.zeros((1, 2, 1, 4)); v = jnp.arange(8.0).reshape(1, 2, 1, 4)
    >>> ring_attention(q, k, v, causal=True)[0, :, 0].tolist()  # row 0 sees key 0; row 1 the mean of both
    [[0.0, 1.0, 2.0, 3.0], [2.0, 3.0, 4.0, 5.0]]
    """
    n = ring_axis_size(axis_name)
    if axis_name is None or n == 1:
        return flash_attention(
            query,
            key,
            value,
            q_segment_ids=q_segment_ids,
            kv_segment_ids=kv_segment_ids,
            softmax_scale=softmax_scale,
            causal=causal,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )
    t, s = query.shape[1], key.shape[1]

    def whole(x: jax.Array, local: int) -> jax.Array:
        """The whole sequence in natural order, from every device's laid-out part."""
        gathered = lax.all_gather(x, axis_name, axis=1, tiled=True)
        natural = layout_permutation(layout, n, n * local).argsort()
        return jnp.take(gathered, jnp.asarray(natural, jnp.int32), axis=1)

    out = flash_attention(
        whole(query, t),
        whole(key, s),
        whole(value, s),
        q_segment_ids=None if q_segment_ids is None else whole(q_segment_ids, t),
        kv_segment_ids=None if kv_segment_ids is None else whole(kv_segment_ids, s),
        softmax_scale=softmax_scale,
        causal=causal,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
    )
    laid_out = jnp.take(out, jnp.asarray(layout_permutation(layout, n, n * t), jnp.int32), axis=1)
    return lax.dynamic_slice_in_dim(laid_out, lax.axis_index(axis_name) * t, t, axis=1)
