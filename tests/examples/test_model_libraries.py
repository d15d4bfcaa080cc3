"""The README's transformer block in Flax linen, Flax NNX and Equinox, trained on CPU until its loss falls.

The task: predict each token's running mean over the unpadded tokens so far, which the block can
represent exactly (uniform attention over the causal, padding-masked keys), so a few SGD steps must cut
the loss. Each test skips where its library is not installed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest

from ejkernel.modules import flash_attention

B, T, HEADS, HEAD_DIM = 4, 16, 4, 16
FEATURES = HEADS * HEAD_DIM  # the linen block reshapes its attention output to x.shape
STEPS, LR = 20, 0.5


def _data() -> tuple[jax.Array, jax.Array, jax.Array]:
    """Input [B, T, F], key-padding mask [B, 1, 1, S] (the last keys of some rows masked), target [B, T, F]."""
    x = jax.random.normal(jax.random.key(0), (B, T, FEATURES))
    keep = jnp.arange(T) < jnp.array([[T], [12], [9], [T]])  # [B, S]: True = a real token
    mask = keep[:, None, None, :]
    weights = jnp.tril(jnp.ones((T, T))) * keep[:, None, :]  # [B, T, S]: the keys each query may see
    return x, mask, (weights @ x) / weights.sum(-1, keepdims=True)


def _sgd(loss: Callable[[Any], jax.Array], params: Any) -> tuple[float, float]:
    """``STEPS`` of plain gradient descent on ``loss``, jitted; the loss before and after."""
    step = jax.jit(lambda params: jax.tree.map(lambda p, g: p - LR * g, params, jax.grad(loss)(params)))
    first = float(jax.jit(loss)(params))
    for _ in range(STEPS):
        params = step(params)
    return first, float(jax.jit(loss)(params))


def _check(first: float, last: float) -> None:
    assert last < 0.7 * first, f"loss {first:.4f} -> {last:.4f} after {STEPS} steps"


def test_flax_linen():
    nn = pytest.importorskip("flax.linen")

    class TransformerBlock(nn.Module):  # the seed README's block, verbatim
        num_heads: int = 8
        head_dim: int = 64

        @nn.compact
        def __call__(self, x, mask=None):
            q = nn.Dense(self.num_heads * self.head_dim)(x)
            k = nn.Dense(self.num_heads * self.head_dim)(x)
            v = nn.Dense(self.num_heads * self.head_dim)(x)
            shape = (x.shape[0], x.shape[1], self.num_heads, self.head_dim)
            q, k, v = map(lambda t: t.reshape(shape), (q, k, v))
            attn_output = flash_attention(q, k, v, causal=True, attention_mask=mask)
            return nn.Dense(x.shape[-1])(attn_output.reshape(x.shape))

    x, mask, y = _data()
    block = TransformerBlock(num_heads=HEADS, head_dim=HEAD_DIM)
    params = block.init(jax.random.key(1), x, mask)
    _check(*_sgd(lambda p: jnp.mean((block.apply(p, x, mask) - y) ** 2), params))


def test_flax_nnx():
    nnx = pytest.importorskip("flax.nnx")

    class TransformerBlock(nnx.Module):
        def __init__(self, features, num_heads, head_dim, *, rngs):
            self.num_heads, self.head_dim = num_heads, head_dim
            self.q = nnx.Linear(features, num_heads * head_dim, rngs=rngs)
            self.k = nnx.Linear(features, num_heads * head_dim, rngs=rngs)
            self.v = nnx.Linear(features, num_heads * head_dim, rngs=rngs)
            self.out = nnx.Linear(num_heads * head_dim, features, rngs=rngs)

        def __call__(self, x, mask=None):
            shape = (x.shape[0], x.shape[1], self.num_heads, self.head_dim)
            q, k, v = (proj(x).reshape(shape) for proj in (self.q, self.k, self.v))
            attn_output = flash_attention(q, k, v, causal=True, attention_mask=mask)
            return self.out(attn_output.reshape(x.shape[0], x.shape[1], -1))

    x, mask, y = _data()
    graphdef, params = nnx.split(TransformerBlock(FEATURES, HEADS, HEAD_DIM, rngs=nnx.Rngs(1)))
    _check(*_sgd(lambda p: jnp.mean((nnx.merge(graphdef, p)(x, mask) - y) ** 2), params))


def test_equinox():
    eqx = pytest.importorskip("equinox")

    class TransformerBlock(eqx.Module):
        q: eqx.nn.Linear
        k: eqx.nn.Linear
        v: eqx.nn.Linear
        out: eqx.nn.Linear
        num_heads: int = eqx.field(static=True)
        head_dim: int = eqx.field(static=True)

        def __init__(self, features, num_heads, head_dim, *, key):
            kq, kk, kv, ko = jax.random.split(key, 4)
            self.q = eqx.nn.Linear(features, num_heads * head_dim, key=kq)
            self.k = eqx.nn.Linear(features, num_heads * head_dim, key=kk)
            self.v = eqx.nn.Linear(features, num_heads * head_dim, key=kv)
            self.out = eqx.nn.Linear(num_heads * head_dim, features, key=ko)
            self.num_heads, self.head_dim = num_heads, head_dim

        def __call__(self, x, mask=None):
            # eqx.nn.Linear maps one vector: vmap it over the batch and the tokens.
            shape = (x.shape[0], x.shape[1], self.num_heads, self.head_dim)
            q, k, v = (jax.vmap(jax.vmap(proj))(x).reshape(shape) for proj in (self.q, self.k, self.v))
            attn_output = flash_attention(q, k, v, causal=True, attention_mask=mask)
            return jax.vmap(jax.vmap(self.out))(attn_output.reshape(x.shape[0], x.shape[1], -1))

    x, mask, y = _data()
    params, static = eqx.partition(TransformerBlock(FEATURES, HEADS, HEAD_DIM, key=jax.random.key(1)), eqx.is_array)
    _check(*_sgd(lambda p: jnp.mean((eqx.combine(p, static)(x, mask) - y) ** 2), params))
