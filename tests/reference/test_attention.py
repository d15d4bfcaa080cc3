"""The ``attention`` reference on cases worked out by hand.

Zero queries and keys give every admitted key the same score: the weights are ``1 / (admitted keys)``
and the output is the mean of the admitted values. With ``v[j] = j`` the output is the mean position.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from ejkernel.kernels.signatures._attention import dropout_keep
from ejkernel.testing.reference import attention


def _positions(b: int, s: int, k: int, dv: int) -> jnp.ndarray:
    """Values ``v[b, j, k, :] = j``."""
    return jnp.broadcast_to(jnp.arange(s, dtype=jnp.float32)[None, :, None, None], (b, s, k, dv))


def test_one_key_gets_all_the_weight():
    q = jnp.ones((1, 1, 1, 4))
    k = jnp.full((1, 1, 1, 4), 3.0)
    v = jnp.arange(4.0).reshape(1, 1, 1, 4)
    out, weights = attention(q, k, v, return_weights=True)
    assert weights.tolist() == [[[[1.0]]]]
    assert out[0, 0, 0].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_uniform_scores_give_the_mean_and_equal_weights():
    q, k = jnp.zeros((2, 3, 2, 8)), jnp.zeros((2, 5, 1, 8))  # MQA: both query heads read kv head 0
    out, weights = attention(q, k, _positions(2, 5, 1, 8), return_weights=True)
    np.testing.assert_allclose(weights, np.full((2, 2, 3, 5), 0.2), rtol=1e-6)
    np.testing.assert_allclose(out, np.full((2, 3, 2, 8), 2.0), rtol=1e-6)  # mean(0..4)


def test_causal_is_bottom_right_aligned():
    # T = 2, S = 4: query 0 sees keys 0..2, query 1 sees keys 0..3.
    out, weights = attention(
        jnp.zeros((1, 2, 1, 2)), jnp.zeros((1, 4, 1, 2)), _positions(1, 4, 1, 2), causal=True, return_weights=True
    )
    np.testing.assert_allclose(weights[0, 0], [[1 / 3, 1 / 3, 1 / 3, 0], [0.25, 0.25, 0.25, 0.25]], rtol=1e-6)
    np.testing.assert_allclose(out[0, :, 0, 0], [1.0, 1.5], rtol=1e-6)


def test_sliding_window_and_mask_combine():
    # T = S = 4, window (1, 0): query i sees keys i-1 and i; the mask then removes key 1 everywhere.
    mask = jnp.array([True, False, True, True])[None, None, None, :]
    out, weights = attention(
        jnp.zeros((1, 4, 1, 2)), jnp.zeros((1, 4, 1, 2)), _positions(1, 4, 1, 2),
        sliding_window=(1, 0), attention_mask=mask, return_weights=True,
    )  # fmt: skip
    np.testing.assert_allclose(out[0, :, 0, 0], [0.0, 0.0, 2.0, 2.5], rtol=1e-6)
    assert weights[0, 0, 1].tolist() == [1.0, 0.0, 0.0, 0.0]  # query 1: key 0 only
    assert weights[0, 0, 0].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_fully_masked_row_is_zero():
    mask = jnp.array([[True, True], [False, False]])[None, None]
    out, weights = attention(
        jnp.ones((1, 2, 1, 2)), jnp.ones((1, 2, 1, 2)), jnp.ones((1, 2, 1, 2)), attention_mask=mask, return_weights=True
    )
    assert out[0, 1].tolist() == [[0.0, 0.0]] and weights[0, 0, 1].tolist() == [0.0, 0.0]
    assert out[0, 0].tolist() == [[1.0, 1.0]]


def test_scale_bias_and_soft_cap_by_hand():
    # Scores q.k: key 0 -> 1, key 1 -> 0. With scale ln(3) the weights are 3/4 and 1/4.
    q = jnp.array([1.0, 0.0]).reshape(1, 1, 1, 2)
    k = jnp.array([[1.0, 0.0], [0.0, 0.0]]).reshape(1, 2, 1, 2)
    v = jnp.array([[4.0], [0.0]]).reshape(1, 2, 1, 1)
    _, w = attention(q, k, v, softmax_scale=math.log(3), return_weights=True)
    np.testing.assert_allclose(w[0, 0, 0], [0.75, 0.25], rtol=1e-6)
    # A bias of -ln(3) on key 0 cancels it: equal weights.
    bias = jnp.array([-math.log(3), 0.0]).reshape(1, 1, 1, 2)
    out, w = attention(q, k, v, bias, softmax_scale=math.log(3), return_weights=True)
    np.testing.assert_allclose(w[0, 0, 0], [0.5, 0.5], rtol=1e-6)
    np.testing.assert_allclose(out[0, 0, 0], [2.0], rtol=1e-6)
    # Soft cap c: score 1 -> c * tanh(1 / c); with c = 0.5 the weights are softmax([0.5 tanh 2, 0]).
    _, w = attention(q, k, v, softmax_scale=1.0, logits_soft_cap=0.5, return_weights=True)
    e = math.exp(0.5 * math.tanh(2.0))
    np.testing.assert_allclose(w[0, 0, 0], [e / (e + 1), 1 / (e + 1)], rtol=1e-6)


def test_dropout_drops_the_contracts_entries_and_rescales():
    p, seed = 0.5, 11
    out, w = attention(jnp.zeros((1, 4, 2, 2)), jnp.zeros((1, 8, 1, 2)), _positions(1, 8, 1, 2),
                       dropout_prob=p, dropout_seed=seed, return_weights=True)  # fmt: skip
    b, h, i, j = np.meshgrid(np.arange(1), np.arange(2), np.arange(4), np.arange(8), indexing="ij")
    keep = dropout_keep(seed, b, h, i, j, 2, p)
    np.testing.assert_allclose(w, np.where(keep, (1 / 8) / (1 - p), 0.0), rtol=1e-6)
    # out = sum of the surviving positions / 8 / (1 - p)
    np.testing.assert_allclose(out[0, :, :, 0].T, (keep * np.arange(8)).sum(-1)[0] / 8 / (1 - p), rtol=1e-6)
