"""The ``scaled_dot_product_attention`` reference on cases worked out by hand (jax's semantics).

Zero queries and keys give every admitted key the same score, so the output is the mean of the
admitted values; with ``v[j] = j`` it is the mean admitted key position.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from ejkernel.testing.reference import scaled_dot_product_attention as sdpa


def _uniform(b: int, t: int, s: int, n: int = 1, k: int = 1) -> tuple[jnp.ndarray, ...]:
    """Zero queries and keys; values ``v[b, j, k, :] = j``."""
    v = jnp.broadcast_to(jnp.arange(s, dtype=jnp.float32)[None, :, None, None], (b, s, k, 2))
    return jnp.zeros((b, t, n, 2)), jnp.zeros((b, s, k, 2)), v


def test_causal_is_top_left_aligned():
    # T = 3, S = 5: query i sees keys 0..i (jax's tril), whatever S is.
    out = sdpa(*_uniform(1, 3, 5), is_causal=True)
    np.testing.assert_allclose(out[0, :, 0, 0], [0.0, 0.5, 1.0], rtol=1e-6)
    # T = 4, S = 2: queries 1..3 see both keys.
    out = sdpa(*_uniform(1, 4, 2), is_causal=True)
    np.testing.assert_allclose(out[0, :, 0, 0], [0.0, 0.5, 0.5, 0.5], rtol=1e-6)


def test_local_window_is_top_left_aligned():
    # T = S = 5, window (1, 2): query i sees keys i-1 .. i+2.
    out = sdpa(*_uniform(1, 5, 5), local_window_size=(1, 2))
    np.testing.assert_allclose(out[0, :, 0, 0], [1.0, 1.5, 2.5, 3.0, 3.5], rtol=1e-6)
    # An int w means (w, w): query 0 of T = 1, S = 4 with w = 1 sees keys 0 and 1.
    np.testing.assert_allclose(sdpa(*_uniform(1, 1, 4), local_window_size=1)[0, 0, 0, 0], 0.5, rtol=1e-6)


def test_seq_lengths_pad_queries_and_keys():
    q, k, v = _uniform(2, 3, 4)
    out = sdpa(
        q, k, v, query_seq_lengths=jnp.array([3, 1], jnp.int32), key_value_seq_lengths=jnp.array([2, 4], jnp.int32)
    )
    np.testing.assert_allclose(out[0, :, 0, 0], [0.5, 0.5, 0.5], rtol=1e-6)  # keys 0, 1
    np.testing.assert_allclose(out[1, :, 0, 0], [1.5, 0.0, 0.0], rtol=1e-6)  # rows 1, 2 are padding


def test_rows_without_keys_are_zero():
    # jax would give the mean of all values (1.5) on these rows; the contract gives zeros.
    q, k, v = _uniform(1, 2, 4)
    mask = jnp.array([[True, False, True, False], [False, False, False, False]])[None, None]
    out = sdpa(q, k, v, None, mask)
    np.testing.assert_allclose(out[0, :, 0, 0], [1.0, 0.0], rtol=1e-6)
    assert float(sdpa(q, k, v, key_value_seq_lengths=jnp.array([0], jnp.int32)).max()) == 0.0


def test_mask_broadcasts_along_every_axis_of_size_one():
    q, k, v = _uniform(2, 2, 3, n=2)
    mask = jnp.array([True, False, True])[None, None, None, :]  # [1, 1, 1, S]: key 1 hidden everywhere
    np.testing.assert_allclose(sdpa(q, k, v, None, mask)[..., 0], np.ones((2, 2, 2)), rtol=1e-6)


def test_scale_bias_and_gqa_by_hand():
    # Two query heads share kv head 0. Scores q.k: key 0 -> 1, key 1 -> 0; scale ln(3) -> weights 3/4, 1/4.
    q = jnp.array([[1.0, 0.0], [1.0, 0.0]]).reshape(1, 1, 2, 2)
    k = jnp.array([[1.0, 0.0], [0.0, 0.0]]).reshape(1, 2, 1, 2)
    v = jnp.array([[4.0], [0.0]]).reshape(1, 2, 1, 1)
    np.testing.assert_allclose(sdpa(q, k, v, scale=math.log(3))[0, 0, :, 0], [3.0, 3.0], rtol=1e-6)
    # A per-head bias [1, N, 1, S]: head 1 gets -ln(3) on key 0, which cancels its score.
    bias = jnp.array([[0.0, 0.0], [-math.log(3), 0.0]]).reshape(1, 2, 1, 2)
    np.testing.assert_allclose(sdpa(q, k, v, bias, scale=math.log(3))[0, 0, :, 0], [3.0, 2.0], rtol=1e-6)
    # Default scale H ** -0.5 = 2 ** -0.5.
    e = math.exp(2**-0.5)
    np.testing.assert_allclose(sdpa(q, k, v)[0, 0, 0, 0], 4 * e / (e + 1), rtol=1e-6)
