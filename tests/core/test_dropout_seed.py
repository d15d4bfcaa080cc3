"""The seed's quick start, ``flash_attention(q, k, v, causal=True, dropout_prob=0.1)`` with no seed, runs: its
mask comes from a hash of the query, so it changes whenever the query does and never stays fixed across steps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.kernels.signatures._attention import seed_from_query
from ejkernel.modules import attention, flash_attention


def _qkv(seed: int):
    ks = jax.random.split(jax.random.key(seed), 3)
    return [jax.random.normal(k, (1, 16, 2, 8)) for k in ks]


def test_the_seed_quick_start_runs_and_a_new_query_draws_a_new_mask():
    q, k, v = _qkv(0)
    out = flash_attention(q, k, v, causal=True, dropout_prob=0.1)
    assert out.shape == q.shape and bool(jnp.all(jnp.isfinite(out)))
    # The same query: the same mask (the seed is the query's hash, given explicitly here).
    same = flash_attention(q, k, v, causal=True, dropout_prob=0.1, dropout_seed=seed_from_query(q))
    np.testing.assert_array_equal(out, same)
    # One ulp of change in the query (the next training step): another mask, under jit too.
    q2 = q.at[0, 3, 1, 2].set(jnp.nextafter(q[0, 3, 1, 2], jnp.inf))
    f = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=True, dropout_prob=0.1))
    _, weights = attention(q, k, v, causal=True, dropout_prob=0.5, return_weights=True)
    _, weights2 = attention(q2, k, v, causal=True, dropout_prob=0.5, return_weights=True)
    dropped, dropped2 = np.asarray(weights) == 0, np.asarray(weights2) == 0
    assert dropped.any() and (dropped != dropped2).any(), "a changed query must draw another mask"
    assert int(seed_from_query(q)) != int(seed_from_query(q2))
    np.testing.assert_allclose(f(q, k, v), out, rtol=1e-6, atol=1e-6)


def test_gradients_use_the_forwards_mask():
    q, k, v = _qkv(1)

    def loss(q, k, v, seed=None):
        return jnp.sum(flash_attention(q, k, v, causal=True, dropout_prob=0.3, dropout_seed=seed) ** 2)

    got = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    seed = seed_from_query(q)
    want = jax.grad(lambda q, k, v: loss(q, k, v, seed), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
