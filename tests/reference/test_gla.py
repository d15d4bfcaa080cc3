"""The ``gla`` reference on cases worked out by hand (small numbers, or closed forms written in NumPy)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.testing import reference

# Compiled whole: eager op-by-op dispatch would compile every small op separately, which is slower.
gla = jax.jit(reference.gla, static_argnames=("scale", "output_final_state"))


def test_two_steps_written_out():
    # K=2, V=1, one head. Key channel 0 halves each step, channel 1 keeps everything.
    q = jnp.array([[1.0, 0.0], [1.0, 1.0]]).reshape(1, 2, 1, 2)
    k = jnp.array([[1.0, 1.0], [0.0, 1.0]]).reshape(1, 2, 1, 2)
    v = jnp.array([2.0, 3.0]).reshape(1, 2, 1, 1)
    g = jnp.log(jnp.array([[0.5, 1.0], [0.5, 1.0]])).reshape(1, 2, 1, 2)
    o, s = gla(q, k, v, g, scale=1.0, output_final_state=True)
    # S_1 = k_1^T v_1 = [[2], [2]]; o_1 = q_1 S_1 = 2.
    # S_2 = diag(0.5, 1) S_1 + k_2^T v_2 = [[1], [2 + 3]]; o_2 = q_2 S_2 = 1 + 5 = 6.
    np.testing.assert_allclose(np.asarray(o).ravel(), [2.0, 6.0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(s).ravel(), [1.0, 5.0], rtol=1e-6)


def test_one_token_reads_the_decayed_initial_state():
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 1, 1, 3)), rng.standard_normal((2, 1, 1, 3))
    v, g = rng.standard_normal((2, 1, 1, 4)), -rng.uniform(0, 2, (2, 1, 1, 3))
    h0 = rng.standard_normal((2, 1, 3, 4))
    o, s = gla(*(jnp.asarray(x, jnp.float32) for x in (q, k, v, g)), initial_state=jnp.asarray(h0, jnp.float32),
               output_final_state=True)  # fmt: skip
    want_s = np.exp(g[:, 0, 0])[:, :, None] * h0[:, 0] + k[:, 0, 0][:, :, None] * v[:, 0, 0][:, None, :]
    want_o = 3**-0.5 * np.einsum("bk,bkv->bv", q[:, 0, 0], want_s)
    np.testing.assert_allclose(np.asarray(s)[:, 0], want_s, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(o)[:, 0, 0], want_o, rtol=1e-5, atol=1e-6)


def test_closed_form_of_the_recurrence():
    # o_t = sum_{s <= t} sum_i q_t[i] k_s[i] exp(G_t[i] - G_s[i]) v_s + q_t exp(G_t) h0, G = cumsum(g).
    rng = np.random.default_rng(1)
    t, dk, dv = 6, 3, 2
    q, k, v = rng.standard_normal((t, dk)), rng.standard_normal((t, dk)), rng.standard_normal((t, dv))
    g, h0 = -rng.uniform(0, 1, (t, dk)), rng.standard_normal((dk, dv))
    G = np.cumsum(g, axis=0)
    want = np.stack([
        sum(((q[i] * k[s] * np.exp(G[i] - G[s])) @ np.ones(dk)) * v[s] for s in range(i + 1))
        + (q[i] * np.exp(G[i])) @ h0
        for i in range(t)
    ])  # fmt: skip
    o, _ = gla(*(jnp.asarray(x[None, :, None], jnp.float32) for x in (q, k, v, g)), scale=1.0,
               initial_state=jnp.asarray(h0[None, None], jnp.float32))  # fmt: skip
    np.testing.assert_allclose(np.asarray(o)[0, :, 0], want, rtol=1e-5, atol=1e-5)


def test_packed_sequences_restart_and_end_on_their_own():
    rng = np.random.default_rng(2)
    x = {n: jnp.asarray(rng.standard_normal((1, 9, 2, 3)), jnp.float32) for n in ("q", "k", "v")}
    x["g"] = jnp.asarray(-rng.uniform(0, 1, (1, 9, 2, 3)), jnp.float32)
    h0 = jnp.asarray(rng.standard_normal((3, 2, 3, 3)), jnp.float32)
    cu = jnp.array([0, 4, 4, 8])  # lengths 4, 0, 4; token 8 is in no sequence
    o, s = gla(**x, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    for n, (a, b) in enumerate([(0, 4), (4, 4), (4, 8)]):
        part = {name: arr[:, a:b] for name, arr in x.items()}
        if b > a:
            o_n, s_n = gla(**part, initial_state=h0[n : n + 1], output_final_state=True)
            np.testing.assert_allclose(np.asarray(o)[:, a:b], np.asarray(o_n), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(np.asarray(s)[n], np.asarray(s_n)[0], rtol=1e-5, atol=1e-6)
        else:  # an empty sequence keeps its initial state
            np.testing.assert_array_equal(np.asarray(s)[n], np.asarray(h0)[n])
    assert np.all(np.asarray(o)[:, 8] == 0)


def test_low_precision_input_gives_its_dtype_and_a_float32_state():
    x = jnp.ones((1, 3, 1, 2), jnp.bfloat16)
    o, s = gla(x, x, x, jnp.zeros((1, 3, 1, 2)), output_final_state=True)
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    o, s = gla(x, x, x, jnp.zeros((1, 3, 1, 2)))
    assert s is None


def test_grouped_value_heads_are_single_heads_reading_their_query_key_head():
    # H=2 query/key heads, HV=4 value heads: value head hv is the one-head recurrence over q, k head hv // 2
    # with its own v, g and state.
    rng = np.random.default_rng(3)
    q, k = (jnp.asarray(rng.standard_normal((2, 5, 2, 3)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((2, 5, 4, 2)), jnp.float32)
    g = jnp.asarray(-rng.uniform(0, 1, (2, 5, 4, 3)), jnp.float32)
    h0 = jnp.asarray(rng.standard_normal((2, 4, 3, 2)), jnp.float32)
    o, s = gla(q, k, v, g, initial_state=h0, output_final_state=True)
    assert o.shape == (2, 5, 4, 2) and s.shape == (2, 4, 3, 2)
    for hv in range(4):
        one = slice(hv // 2, hv // 2 + 1)
        mine = slice(hv, hv + 1)
        o_h, s_h = gla(q[:, :, one], k[:, :, one], v[:, :, mine], g[:, :, mine], initial_state=h0[:, mine],
                       output_final_state=True)  # fmt: skip
        np.testing.assert_allclose(np.asarray(o)[:, :, mine], np.asarray(o_h), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(s)[:, mine], np.asarray(s_h), rtol=1e-5, atol=1e-6)
