"""The ``gated_delta_rule`` reference on cases worked out by hand.

One step is ``S = a S; S += beta k (v - S^T k)^T; o = scale S^T q`` with ``a = exp(g)``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.testing import reference

# compiled whole (eager dispatch of the scan is slower than compiling it)
gated_delta_rule = jax.jit(reference.gated_delta_rule, static_argnames=("scale", "output_final_state", "use_qk_l2norm"))


def _tokens(*rows: list[float]) -> jnp.ndarray:
    """``[1, T, 1, D]`` from one list per token."""
    return jnp.asarray(rows, jnp.float32)[None, :, None, :]


def _gates(*values: float) -> jnp.ndarray:
    return jnp.asarray(values, jnp.float32)[None, :, None]


def test_one_step_from_an_initial_state():
    # S0 = 2, a = 0.5: S = 1; read 1 at k = 1; S += 0.5 * (3 - 1) = 2; o = 2 * q = 2 * 1.5.
    o, s = gated_delta_rule(
        _tokens([1.5]), _tokens([1.0]), _tokens([3.0]), _gates(math.log(0.5)), _gates(0.5),
        scale=1.0, initial_state=jnp.full((1, 1, 1, 1), 2.0), output_final_state=True,
    )  # fmt: skip
    assert float(o[0, 0, 0, 0]) == 3.0
    assert float(s[0, 0, 0, 0]) == 2.0


def test_two_steps_written_out():
    # K = 2, V = 1, S0 = 0.
    # t = 1: a = 1, beta = 1, k = e1, v = 4:      S = [4, 0];  o = S . q1 = S . e2 = 0.
    # t = 2: a = 1/2, beta = 1/2, k = (1, 1)/sqrt2, v = 1: S = [2, 0]; read = 2/sqrt2 = sqrt2;
    #        S += k * (1 - sqrt2)/2 = [2, 0] + (1 - sqrt2)/(2 sqrt2) [1, 1];  o = S . e1.
    r = 1 / math.sqrt(2)
    o, s = gated_delta_rule(
        _tokens([0.0, 1.0], [1.0, 0.0]), _tokens([1.0, 0.0], [r, r]), _tokens([4.0], [1.0]),
        _gates(0.0, math.log(0.5)), _gates(1.0, 0.5), scale=1.0, output_final_state=True,
    )  # fmt: skip
    step = (1 - math.sqrt(2)) / (2 * math.sqrt(2))
    np.testing.assert_allclose(o[0, :, 0, 0], [0.0, 2 + step], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(s[0, 0, :, 0], [2 + step, step], rtol=1e-6)


def test_beta_one_overwrites_the_value_at_a_unit_key():
    # Whatever the state held at k, after a step with beta = 1 and no decay, reading at k gives v.
    key = jax.random.key(0)
    k = jnp.asarray([0.6, 0.0, 0.8])  # unit norm
    v = jnp.asarray([1.0, -2.0])
    s0 = jax.random.normal(key, (1, 1, 3, 2))
    o, _ = gated_delta_rule(
        k[None, None, None], k[None, None, None], v[None, None, None], _gates(0.0), _gates(1.0),
        scale=1.0, initial_state=s0,
    )  # fmt: skip
    np.testing.assert_allclose(o[0, 0, 0], v, rtol=1e-5)


def test_beta_zero_only_decays_the_state():
    s0 = jnp.arange(6.0).reshape(1, 1, 3, 2)
    q = _tokens([1.0, 0.0, 0.0], [0.0, 0.0, 1.0])
    o, s = gated_delta_rule(
        q, _tokens([1.0, 0.0, 0.0], [0.0, 1.0, 0.0]), _tokens([5.0, 5.0], [5.0, 5.0]),
        _gates(math.log(0.5), math.log(0.5)), _gates(0.0, 0.0), initial_state=s0, output_final_state=True,
    )  # fmt: skip
    scale = 3**-0.5  # the default, K ** -0.5
    np.testing.assert_allclose(o[0, 0, 0], scale * 0.5 * np.array([0.0, 1.0]), rtol=1e-6)  # row 0 of S0, halved
    np.testing.assert_allclose(o[0, 1, 0], scale * 0.25 * np.array([4.0, 5.0]), rtol=1e-6)  # row 2, quartered
    np.testing.assert_allclose(s, 0.25 * s0, rtol=1e-6)


def test_l2_norm_makes_the_scale_of_q_and_k_irrelevant():
    q, k = jax.random.normal(jax.random.key(1), (2, 1, 4, 2, 8))
    v = jax.random.normal(jax.random.key(2), (1, 4, 2, 3))
    g, beta = jnp.full((1, 4, 2), -0.1), jnp.full((1, 4, 2), 0.5)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    want, _ = gated_delta_rule(unit(q), unit(k), v, g, beta)
    got, _ = gated_delta_rule(10 * q, 0.1 * k, v, g, beta, use_qk_l2norm=True)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_packed_sequences_run_separately_and_an_empty_one_keeps_its_state():
    q, k = jax.random.normal(jax.random.key(3), (2, 1, 5, 1, 2))
    v = jax.random.normal(jax.random.key(4), (1, 5, 1, 2))
    g, beta = jnp.full((1, 5, 1), -0.2), jnp.full((1, 5, 1), 0.3)
    s0 = jax.random.normal(jax.random.key(5), (3, 1, 2, 2))
    o, s = gated_delta_rule(
        q, k, v, g, beta, cu_seqlens=jnp.array([0, 2, 2, 5]), initial_state=s0, output_final_state=True
    )
    for n, (lo, hi) in ((0, (0, 2)), (2, (2, 5))):
        part = [x[:, lo:hi] for x in (q, k, v, g, beta)]
        o_n, s_n = gated_delta_rule(*part, initial_state=s0[n : n + 1], output_final_state=True)
        np.testing.assert_allclose(o[:, lo:hi], o_n, rtol=1e-6)
        np.testing.assert_allclose(s[n], s_n[0], rtol=1e-6)
    np.testing.assert_array_equal(s[1], s0[1])


def test_grouped_value_heads_are_single_heads_reading_their_query_key_head():
    # H=2 query/key heads, HV=4 value heads: value head hv is the one-head rule over q, k head hv // 2 with
    # its own v, g, beta and state.
    q, k = jax.random.normal(jax.random.key(6), (2, 2, 5, 2, 3))
    v = jax.random.normal(jax.random.key(7), (2, 5, 4, 2))
    g = -jax.nn.softplus(jax.random.normal(jax.random.key(8), (2, 5, 4)))
    beta = jax.nn.sigmoid(jax.random.normal(jax.random.key(9), (2, 5, 4)))
    s0 = jax.random.normal(jax.random.key(10), (2, 4, 3, 2))
    o, s = gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm=True)
    assert o.shape == (2, 5, 4, 2) and s.shape == (2, 4, 3, 2)
    for hv in range(4):
        one, mine = slice(hv // 2, hv // 2 + 1), slice(hv, hv + 1)
        o_h, s_h = gated_delta_rule(
            q[:, :, one], k[:, :, one], v[:, :, mine], g[:, :, mine], beta[:, :, mine],
            initial_state=s0[:, mine], output_final_state=True, use_qk_l2norm=True,
        )  # fmt: skip
        np.testing.assert_allclose(o[:, :, mine], o_h, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(s[:, mine], s_h, rtol=1e-5, atol=1e-6)
