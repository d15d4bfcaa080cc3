"""The ``lightning_attn`` reference on cases worked out by hand."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.testing import reference

lightning_attn = jax.jit(reference.lightning_attn, static_argnames=("scale", "output_final_state"))


def test_halving_decay_written_out():
    q = k = jnp.ones((1, 3, 1, 1))
    v = jnp.array([4.0, 2.0, 1.0]).reshape(1, 3, 1, 1)
    o, s = lightning_attn(q, k, v, jnp.array([np.log(2.0)]), scale=1.0, output_final_state=True)
    # 4; 0.5 * 4 + 2 = 4; 0.5 * 4 + 1 = 3
    np.testing.assert_allclose(np.asarray(o).ravel(), [4.0, 4.0, 3.0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(s).ravel(), [3.0], rtol=1e-6)


def test_closed_form_per_head():
    # o_t = scale * sum_{s <= t} exp(-slope (t - s)) (q_t . k_s) v_s, each head with its own slope.
    rng = np.random.default_rng(0)
    t, h, dk, dv = 7, 3, 4, 2
    q, k, v = rng.standard_normal((t, h, dk)), rng.standard_normal((t, h, dk)), rng.standard_normal((t, h, dv))
    slope = np.array([0.0, 0.3, 2.0])
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    decay = np.where(j <= i, np.exp(-slope[:, None, None] * (i - j)), 0.0)  # [H, T, T]
    want = 0.5 * np.einsum("hts,tha,sha,shv->thv", decay, q, k, v)
    o, _ = lightning_attn(*(jnp.asarray(x[None], jnp.float32) for x in (q, k, v)), jnp.asarray(slope, jnp.float32))
    np.testing.assert_allclose(np.asarray(o)[0], want, rtol=1e-5, atol=1e-5)


def test_initial_state_decays_with_the_slope():
    h0 = jnp.ones((1, 1, 1, 1))
    zeros = jnp.zeros((1, 4, 1, 1))
    q = jnp.ones((1, 4, 1, 1))
    o, s = lightning_attn(q, zeros, zeros, jnp.array([1.0]), scale=1.0, initial_state=h0, output_final_state=True)
    np.testing.assert_allclose(np.asarray(o).ravel(), np.exp(-np.arange(1, 5.0)), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(s).ravel(), [np.exp(-4.0)], rtol=1e-6)
