"""The ``multi_head_latent_attention`` reference on cases worked out by hand.

Layout: query ``[B, T, H, D]``, dense kv ``[B, S, D]`` or a paged cache ``[P, page, D]``; D = Dl + Dr,
the value is ``kv[..., :Dl]``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.testing.conformance._harness import jitted
from ejkernel.testing.reference import multi_head_latent_attention as reference


def mla(q, kv, **kwargs):
    """The reference, compiled as one program (op-by-op dispatch compiles every operation on its own)."""
    return jitted(reference, **kwargs)(q, kv)


def test_one_key_gives_its_latent_part_to_every_head():
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 1, 3, 5)), jnp.float32)
    kv = jnp.asarray([[[1.0, 2.0, 3.0, 4.0, 5.0]]])
    out = mla(q, kv, latent_dim=3)
    np.testing.assert_allclose(out[0, 0], [[1.0, 2.0, 3.0]] * 3)


def test_equal_scores_give_the_mean_of_the_values():
    q = jnp.zeros((1, 1, 2, 3))
    kv = jnp.asarray([[[0.0, 3.0, 9.0], [6.0, 0.0, -9.0], [3.0, 3.0, 0.0]]])
    np.testing.assert_allclose(mla(q, kv, latent_dim=2)[0, 0], [[3.0, 2.0], [3.0, 2.0]])


def test_rotary_dims_score_but_are_not_values():
    # Dl = 2, Dr = 1; only the rotary dim scores: s = (0, ln 3) at scale 1, so weights (1/4, 3/4).
    q = jnp.asarray([[[[0.0, 0.0, math.log(3.0)]]]])
    kv = jnp.asarray([[[4.0, 8.0, 0.0], [0.0, 4.0, 1.0]]])
    out = mla(q, kv, latent_dim=2, softmax_scale=1.0)
    np.testing.assert_allclose(out[0, 0, 0], [0.25 * 4 + 0.75 * 0, 0.25 * 8 + 0.75 * 4], rtol=1e-6)


def test_default_scale_is_the_full_dim_and_576_means_512_latent_dims():
    # D = 576: latent_dim inferred as 512. Scores (0, c) with c = 24 * ln 2 at scale 576**-0.5 = 1/24:
    # scaled (0, ln 2), weights (1/3, 2/3).
    q = jnp.zeros((1, 1, 1, 576)).at[..., 575].set(24 * math.log(2.0))
    kv = jnp.zeros((1, 2, 576)).at[0, 1, 575].set(1.0).at[0, 0, 0].set(3.0).at[0, 1, 0].set(6.0)
    out = mla(q, kv)
    assert out.shape == (1, 1, 1, 512)
    np.testing.assert_allclose(out[0, 0, 0, 0], 3.0 / 3 + 6.0 * 2 / 3, rtol=1e-6)
    with pytest.raises(ValueError, match="latent_dim is required"):
        mla(q[..., :80], kv[..., :80])


def test_causal_is_bottom_right_aligned():
    # T = 2, S = 3: row 0 sees keys 0..1, row 1 sees keys 0..2; equal scores, so means.
    q = jnp.zeros((1, 2, 1, 2))
    kv = jnp.asarray([[[3.0, 0.0], [5.0, 0.0], [10.0, 0.0]]])
    np.testing.assert_allclose(mla(q, kv, latent_dim=1, causal=True)[0, :, 0, 0], [4.0, 6.0])
    # T = 3 > S = 1: rows 0 and 1 see no key and give zeros; row 2 sees key 0.
    out = mla(jnp.zeros((1, 3, 1, 2)), kv[:, :1], latent_dim=1, causal=True)
    np.testing.assert_array_equal(out[0, :, 0, 0], [0.0, 0.0, 3.0])


def test_paged_reads_the_pages_of_the_table_up_to_the_length():
    # Pages of 2 tokens; page p holds values (10p, 10p + 1). Batch 0 reads pages 2, 0 with 3 keys:
    # (20, 21, 0); batch 1 has an empty cache (its table entry is garbage, never read): zeros.
    cache = jnp.stack([jnp.stack([jnp.asarray([10.0 * p + i, 0.0]) for i in range(2)]) for p in range(3)])
    tables = jnp.asarray([[2, 0], [99, -5]], jnp.int32)
    lens = jnp.asarray([3, 0], jnp.int32)
    out = mla(jnp.zeros((2, 1, 1, 2)), cache, latent_dim=1, block_tables=tables, cache_seqlens=lens)
    np.testing.assert_allclose(out[:, 0, 0, 0], [(20 + 21 + 0) / 3, 0.0])
    # Causal with T = 2: row 0 sees keys 0..1 (20, 21), row 1 all three.
    out = mla(jnp.zeros((2, 2, 1, 2)), cache, latent_dim=1, causal=True, block_tables=tables, cache_seqlens=lens)
    np.testing.assert_allclose(out[0, :, 0, 0], [20.5, 41 / 3], rtol=1e-6)


def test_the_latent_gets_gradient_as_key_and_as_value():
    # One query, two keys, Dl = Dr = 1, scale 1: out = sum_j p_j v_j, p = softmax_j(q . k_j), v_j = k_j[0].
    # q = 0 gives p = (1/2, 1/2) and out = 3. Value role: d out / d v_j = p_j = 1/2 (latent dim 0 only).
    # Key role: d out / d k_j = p_j (v_j - out) q = 0 at q = 0. And d out / d q = sum_j p_j (v_j - out) k_j.
    q = jnp.zeros((1, 1, 1, 2))
    kv = jnp.asarray([[[2.0, 1.0], [4.0, -1.0]]])
    loss = lambda q, kv: reference(q, kv, latent_dim=1, softmax_scale=1.0).sum()  # noqa: E731
    dq, dkv = jax.jit(jax.grad(loss, argnums=(0, 1)))(q, kv)
    out = 3.0
    np.testing.assert_allclose(dkv[0], [[0.5, 0.0], [0.5, 0.0]], atol=1e-7)
    want_dq = 0.5 * (2.0 - out) * np.asarray([2.0, 1.0]) + 0.5 * (4.0 - out) * np.asarray([4.0, -1.0])
    np.testing.assert_allclose(dq[0, 0, 0], want_dq, rtol=1e-6)


def test_computes_in_float64_under_x64_and_returns_the_input_dtype():
    with jax.enable_x64(True):
        q = jnp.full((1, 1, 1, 2), 1e-9, jnp.float64)
        kv = jnp.asarray([[[1.0, 0.0], [1.0 + 1e-12, 0.0]]], jnp.float64)
        out = mla(q, kv, latent_dim=1)
        assert out.dtype == jnp.float64
        np.testing.assert_allclose(float(out[0, 0, 0, 0]), 1.0 + 0.5e-12, rtol=1e-15)
    out16 = mla(jnp.zeros((1, 1, 1, 2), jnp.bfloat16), jnp.ones((1, 3, 2), jnp.bfloat16), latent_dim=1)
    assert out16.dtype == jnp.bfloat16
