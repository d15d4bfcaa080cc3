"""The ``page_attention`` reference on cases worked out by hand.

With a zero query every admitted key has the same score, so the output is the mean of the admitted
values. Values are chosen as ``v = position`` of the token in its sequence (through shuffled pages), so
the expected means are plain arithmetic.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.testing import reference

# Compiled whole: eager op-by-op dispatch would compile every small op separately, which is slower.
page_attention = jax.jit(
    reference.page_attention, static_argnames=("softmax_scale", "logits_soft_cap", "sliding_window")
)

PAGE = 4


def cache_with_positions(tables: list[list[int]], num_pages: int, kv_heads: int = 1) -> jax.Array:
    """A value cache in which token ``j`` of sequence ``n`` holds ``100 * n + j`` (every head, every dim: 2);
    every other slot holds 1000."""
    cache = np.full((num_pages, PAGE, kv_heads, 2), 1000.0, np.float32)
    for n, row in enumerate(tables):
        for c, p in enumerate(row):
            if p >= 0:
                cache[p, :, :, :] = (100 * n + c * PAGE + np.arange(PAGE))[:, None, None]
    return jnp.asarray(cache)


def test_uniform_attention_is_the_mean_of_the_context():
    tables = [[5, 2, -1], [0, 3, 1]]
    v = cache_with_positions(tables, 6)
    k = jnp.zeros_like(v)
    q = jnp.zeros((2, 1, 2))
    out = page_attention(q, k, v, jnp.array([6, 9]), jnp.array(tables))
    # Sequence 0: tokens 0..5 -> mean 2.5; sequence 1: 100 + mean(0..8) = 104.
    np.testing.assert_allclose(np.asarray(out[:, 0, 0]), [2.5, 104.0], rtol=1e-6)


def test_one_token_returns_its_value_and_an_empty_sequence_zeros():
    tables = [[4, 0], [1, -1]]
    v = cache_with_positions(tables, 5)
    q = jnp.ones((2, 1, 2))
    out = page_attention(q, jnp.ones_like(v), v, jnp.array([1, 0]), jnp.array(tables))
    assert out[0, 0].tolist() == [0.0, 0.0]  # token 0 of sequence 0 holds 0
    assert out[1].tolist() == [[0.0, 0.0]]


def test_sliding_window_keeps_the_last_positions():
    tables = [[2, 0, 1]]
    v = cache_with_positions(tables, 3)
    k = jnp.zeros_like(v)
    q = jnp.zeros((1, 1, 2))
    out = lambda w: float(page_attention(q, k, v, jnp.array([10]), jnp.array(tables), sliding_window=w)[0, 0, 0])  # noqa: E731
    assert out(1) == 9.0  # its own position only
    assert out(3) == 8.0  # mean(7, 8, 9)
    assert out(50) == 4.5  # wider than the context: every token


def test_gqa_heads_read_their_own_kv_head():
    # kv head 0 values 1, kv head 1 values 2; 4 query heads: heads 0, 1 read kv head 0, heads 2, 3 kv head 1.
    v = jnp.stack([jnp.ones((2, PAGE, 2)), 2 * jnp.ones((2, PAGE, 2))], axis=2)
    out = page_attention(jnp.ones((1, 4, 2)), jnp.ones_like(v), v, jnp.array([3]), jnp.array([[1]]))
    assert out[0, :, 0].tolist() == [1.0, 1.0, 2.0, 2.0]


def test_scores_scale_and_soft_cap_by_hand():
    # One page: keys k0 = 1, k1 = 3 (D = 1), values 0 and 1, query 2: scores scale * (2, 6).
    k = jnp.array([1.0, 3.0, 0.0, 0.0]).reshape(1, 4, 1, 1)
    v = jnp.array([0.0, 1.0, 0.0, 0.0]).reshape(1, 4, 1, 1)
    q = jnp.full((1, 1, 1), 2.0)
    lens, tables = jnp.array([2]), jnp.array([[0]])
    s = np.array([2.0, 6.0]) * 0.5
    assert np.isclose(
        float(page_attention(q, k, v, lens, tables, softmax_scale=0.5)[0, 0, 0]), 1 / (1 + np.exp(s[0] - s[1]))
    )
    capped = 1.5 * np.tanh(s / 1.5)
    got = float(page_attention(q, k, v, lens, tables, softmax_scale=0.5, logits_soft_cap=1.5)[0, 0, 0])
    assert np.isclose(got, 1 / (1 + np.exp(capped[0] - capped[1])), rtol=1e-6)
    # Default scale: D ** -0.5 = 1.
    assert np.isclose(float(page_attention(q, k, v, lens, tables)[0, 0, 0]), 1 / (1 + np.exp(2.0 - 6.0)), rtol=1e-6)


def test_nan_past_the_length_does_not_leak():
    v = cache_with_positions([[0]], 1).at[0, 2:].set(jnp.nan)
    out = page_attention(
        jnp.zeros((1, 1, 2)), jnp.zeros_like(v).at[0, 3].set(jnp.nan), v, jnp.array([2]), jnp.array([[0]])
    )
    assert out[0, 0].tolist() == [0.5, 0.5]


def test_float64_under_x64_and_dtype_preserved():
    tables = [[1, 0]]
    with jax.enable_x64(True):
        v = cache_with_positions(tables, 2).astype(jnp.float64)
        out = page_attention(jnp.zeros((1, 1, 2), jnp.float64), jnp.zeros_like(v), v, jnp.array([7]), jnp.array(tables))
        assert out.dtype == jnp.float64 and abs(float(out[0, 0, 0]) - 3.0) < 1e-12
    v16 = cache_with_positions(tables, 2).astype(jnp.bfloat16)
    assert (
        page_attention(jnp.zeros((1, 1, 2), jnp.bfloat16), v16, v16, jnp.array([7]), jnp.array(tables)).dtype
        == jnp.bfloat16
    )
