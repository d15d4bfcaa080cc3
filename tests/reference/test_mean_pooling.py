"""The ``mean_pooling`` reference on cases worked out by hand."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.testing.reference import mean_pooling


def test_mean_of_each_batch_row():
    x = jnp.asarray([[[1.0], [2.0], [6.0]], [[0.0], [0.0], [3.0]]])
    assert mean_pooling(x).tolist() == [[3.0], [1.0]]


def test_packed_sequences_empty_ones_and_tokens_outside():
    x = jnp.arange(7.0).reshape(1, 7, 1)  # token t holds t
    # sequences [1, 3) and [3, 6), one empty between them; tokens 0 and 6 are outside
    out = mean_pooling(x, cu_seqlens=jnp.array([1, 3, 3, 6]))
    assert out.tolist() == [[1.5], [0.0], [4.0]]


def test_empty_length_gives_zeros():
    assert mean_pooling(jnp.zeros((2, 0, 3))).tolist() == [[0.0] * 3] * 2


def test_gradient_spreads_one_over_the_length():
    x = jnp.ones((1, 6, 2))
    dx = jax.grad(lambda x: mean_pooling(x, cu_seqlens=jnp.array([0, 2, 6])).sum())(x)
    np.testing.assert_allclose(dx[0, :, 0], [0.5, 0.5, 0.25, 0.25, 0.25, 0.25])


def test_bfloat16_is_summed_in_float32():
    x = jnp.ones((1, 1024, 1), jnp.bfloat16)  # a bfloat16 running sum would stall at 256
    out = mean_pooling(x)
    assert out.dtype == jnp.bfloat16 and float(out[0, 0]) == 1.0
