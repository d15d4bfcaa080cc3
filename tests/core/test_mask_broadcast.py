"""A key-padding mask or bias ``[B|1, H|1, 1, S]`` (as Flax and ``jax.nn`` take them) applies to every query row
of ``flash_attention``, forward and gradients, exactly as the same mask written out over the rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.kernels import kernel_registry
from ejkernel.modules import flash_attention


@pytest.fixture(autouse=True)
def _needs_an_implementation():
    if not any(i.runs_on(jax.default_backend()) for i in kernel_registry.implementations("flash_attention")):
        pytest.skip("no flash_attention implementation runs here")


def _inputs():
    q = jax.random.normal(jax.random.key(0), (2, 12, 4, 16))
    k = jax.random.normal(jax.random.key(1), (2, 12, 2, 16))
    v = jax.random.normal(jax.random.key(2), (2, 12, 2, 16))
    return q, k, v


def test_key_padding_mask_is_the_mask_over_every_row():
    q, k, v = _inputs()
    keep = (jnp.arange(12)[None, :] < jnp.array([12, 7])[:, None])[:, None, None, :]  # [B, 1, 1, S]
    full = jnp.broadcast_to(keep, (2, 1, 12, 12))

    def loss(mask):
        return lambda q, k, v: jnp.sum(flash_attention(q, k, v, causal=True, attention_mask=mask) ** 2)

    np.testing.assert_array_equal(
        flash_attention(q, k, v, causal=True, attention_mask=keep),
        flash_attention(q, k, v, causal=True, attention_mask=full),
    )
    for a, b in zip(jax.grad(loss(keep), (0, 1, 2))(q, k, v), jax.grad(loss(full), (0, 1, 2))(q, k, v), strict=True):
        np.testing.assert_array_equal(a, b)


def test_bias_over_keys_broadcasts_and_its_gradient_keeps_its_shape():
    q, k, v = _inputs()
    bias = jax.random.normal(jax.random.key(3), (2, 1, 1, 12))
    full = jnp.broadcast_to(bias, (2, 1, 12, 12))
    np.testing.assert_allclose(flash_attention(q, k, v, bias=bias), flash_attention(q, k, v, bias=full), rtol=1e-6)
    grad = jax.grad(lambda b: jnp.sum(flash_attention(q, k, v, bias=b)))(bias)
    assert grad.shape == bias.shape


def test_a_wrong_mask_is_reported_as_passed():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match=r"attention_mask must have shape .* got \[2, 1, 1, 5\]"):
        flash_attention(q, k, v, attention_mask=jnp.ones((2, 1, 1, 5), bool))
