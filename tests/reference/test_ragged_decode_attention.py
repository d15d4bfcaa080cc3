"""The ``ragged_decode_attention`` reference on cases worked out by hand.

Zero queries and keys give uniform attention: the output is the mean of the values in the row's range,
with ``v[b, j] = j`` that is the mean of the range's positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.testing import reference

# Compiled whole: eager op-by-op dispatch would compile every small op separately, which is slower.
ragged_decode_attention = jax.jit(
    reference.ragged_decode_attention, static_argnames=("softmax_scale", "logits_soft_cap", "sliding_window")
)

S = 10
V = jnp.broadcast_to(jnp.arange(S, dtype=jnp.float32)[None, :, None, None], (4, S, 1, 2))
K = jnp.zeros_like(V)
Q = jnp.zeros((4, 1, 2))


def run(start: list[int], end: list[int], **kw: object) -> list[float]:
    return ragged_decode_attention(Q, K, V, jnp.array(start), jnp.array(end), **kw)[:, 0, 0].tolist()


def test_mean_of_each_range_and_zeros_when_empty():
    # [0, 10): 4.5; [3, 6): 4; [7, 7): empty; [-5, 2) clipped to [0, 2): 0.5.
    assert run([0, 3, 7, -5], [10, 6, 7, 2]) == [4.5, 4.0, 0.0, 0.5]


def test_range_past_the_cache_is_clipped():
    assert run([8, 9, 0, 0], [20, 10, 1, 0]) == [8.5, 9.0, 0.0, 0.0]


def test_sliding_window_counts_back_from_the_end():
    # Window 3: [max(lo, hi - 3), hi): [7, 10) -> 8; [3, 6) -> 4; empty; [0, 2) -> 0.5; window past the start.
    assert run([0, 3, 7, -5], [10, 6, 7, 2], sliding_window=3) == [8.0, 4.0, 0.0, 0.5]
    assert run([0, 3, 7, -5], [10, 6, 7, 2], sliding_window=1) == [9.0, 5.0, 0.0, 1.0]


def test_nan_outside_the_range_does_not_leak():
    v = V.at[:, 6:].set(jnp.nan).at[:, :2].set(jnp.nan)
    k = K.at[:, 6:].set(jnp.nan)
    out = ragged_decode_attention(Q, k, v, jnp.array([2, 2, 5, 2]), jnp.array([6, 4, 6, 2]))[:, 0, 0]
    np.testing.assert_array_equal(np.asarray(out), [3.5, 2.5, 5.0, 0.0])
