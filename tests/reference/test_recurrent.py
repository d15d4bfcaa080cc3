"""The ``recurrent`` reference on cases worked out by hand."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.testing import reference

recurrent = jax.jit(reference.recurrent, static_argnames=("scale", "output_final_state", "reverse"))


def test_reverse_with_a_scalar_gate_written_out():
    q = k = jnp.ones((1, 3, 1, 1))
    v = jnp.array([1.0, 2.0, 4.0]).reshape(1, 3, 1, 1)
    g = jnp.log(jnp.array([0.5, 0.5, 0.5])).reshape(1, 3, 1)
    o, s = recurrent(q, k, v, g, scale=1.0, reverse=True, output_final_state=True)
    # visited 4, then 0.5 * 4 + 2 = 4, then 0.5 * 4 + 1 = 3; the final state is the one after token 0
    np.testing.assert_allclose(np.asarray(o).ravel(), [3.0, 4.0, 4.0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(s).ravel(), [3.0], rtol=1e-6)


def test_every_state_entry_decays_by_all_three_gates():
    # S[i, j] decays by exp(g + g_k[i] + g_v[j]) per step: checked entry by entry with a Python loop.
    rng = np.random.default_rng(0)
    t, dk, dv = 5, 2, 3
    q, k, v = rng.standard_normal((t, dk)), rng.standard_normal((t, dk)), rng.standard_normal((t, dv))
    g, gk, gv = -rng.uniform(0, 1, t), -rng.uniform(0, 1, (t, dk)), -rng.uniform(0, 1, (t, dv))
    state = np.zeros((dk, dv))
    want = []
    for s in range(t):
        for i in range(dk):
            for j in range(dv):
                state[i, j] = np.exp(g[s] + gk[s, i] + gv[s, j]) * state[i, j] + k[s, i] * v[s, j]
        want.append(q[s] @ state)
    args = (
        q[None, :, None],
        k[None, :, None],
        v[None, :, None],
        g[None, :, None],
        gk[None, :, None],
        gv[None, :, None],
    )
    o, final = recurrent(*(jnp.asarray(x, jnp.float32) for x in args), scale=1.0, output_final_state=True)
    np.testing.assert_allclose(np.asarray(o)[0, :, 0], np.array(want), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(final)[0, 0], state, rtol=1e-5, atol=1e-6)


def test_no_gate_is_causal_linear_attention():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 6, 2, 3)).astype(np.float32) for _ in range(3))
    scores = np.einsum("bthd,bshd->bhts", q, k) * np.tril(np.ones((6, 6)))
    want = np.einsum("bhts,bshd->bthd", scores, v) * 3**-0.5
    o, _ = recurrent(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    np.testing.assert_allclose(np.asarray(o), want, rtol=1e-5, atol=1e-5)


def test_packed_sequences_are_reversed_one_by_one():
    q = k = jnp.ones((1, 5, 1, 1))
    v = jnp.arange(1.0, 6.0).reshape(1, 5, 1, 1)
    h0 = jnp.array([10.0, 20.0]).reshape(2, 1, 1, 1)
    o, s = recurrent(q, k, v, scale=1.0, initial_state=h0, reverse=True, output_final_state=True,
                     cu_seqlens=jnp.array([0, 2, 5]))  # fmt: skip
    # sequence [1, 2] from 10: 10 + 2 = 12, 12 + 1 = 13; sequence [3, 4, 5] from 20: 25, 29, 32
    np.testing.assert_allclose(np.asarray(o).ravel(), [13.0, 12.0, 32.0, 29.0, 25.0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(s).ravel(), [13.0, 32.0], rtol=1e-6)
