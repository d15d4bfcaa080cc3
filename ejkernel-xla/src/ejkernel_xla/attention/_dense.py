"""Dense attention in plain JAX: one matmul for the scores, a float32 softmax, one matmul for the output.

Layout. Heads are split into ``K`` kv heads times ``G = H // K`` query heads per group, so GQA/MQA
needs no repeat of keys/values: queries are viewed as ``[B, T, K, G, D]`` and the scores and
probabilities are ``[B, K, G, T, S]`` (query head ``h = kv * G + g``, which reshapes to ``[B, H, T, S]``
for free). Matmuls take the input dtype and accumulate in float32.

Backward: ``jax.custom_vjp`` keeps the inputs and the probabilities ``P`` (float32; the op materialises
them anyway, and they are the weights it can return), plus ``tanh`` of the soft cap when there is one,
rather than the handful of ``[T, S]`` intermediates autodiff would keep. With ``dP = dO V^T`` (plus the
cotangent of the returned weights) and dropout applied to both: ``dV = P_drop^T dO``,
``dS = P * (dP - rowsum(P * dP))`` (times ``1 - tanh^2`` under a soft cap), ``dBias = dS`` summed over
its broadcast axes, ``dQ = scale * dS K`` and ``dK = scale * dS^T Q`` (summed over each group's heads).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ejkernel.kernels.signatures._attention import dropout_keep

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class DenseOptions:
    """Static (hashable) options of one call."""

    scale: float
    soft_cap: float | None = None
    dropout_prob: float = 0.0
    static_seed: int | None = None  # a Python-int seed; an array seed travels with the arrays
    return_weights: bool = False


def grouped(x: jax.Array, k: int, g: int) -> jax.Array:
    """A bias/mask ``[#B, #H, #T, #S]`` -> ``[#B, K|1, G|1, #T, #S]``, broadcastable to the scores."""
    if x.shape[1] == 1:
        return x[:, :, None]
    return x.reshape(x.shape[0], k, g, *x.shape[2:])


def _keep(o: DenseOptions, seed: Any, b: int, k: int, g: int, t: int, s: int) -> jax.Array:
    """Dropout survivors ``[B, K, G, T, S]``: exactly the contract's ``dropout_keep``."""
    bi = jnp.arange(b, dtype=jnp.int32).reshape(b, 1, 1, 1, 1)
    hi = (jnp.arange(k, dtype=jnp.int32)[:, None] * g + jnp.arange(g, dtype=jnp.int32)).reshape(1, k, g, 1, 1)
    ti = jnp.arange(t, dtype=jnp.int32).reshape(1, 1, 1, t, 1)
    si = jnp.arange(s, dtype=jnp.int32).reshape(1, 1, 1, 1, s)
    return dropout_keep(o.static_seed if seed is None else seed, bi, hi, ti, si, k * g, o.dropout_prob, xp=jnp)


def _forward(o: DenseOptions, q: jax.Array, k: jax.Array, v: jax.Array, bias: Any, allowed: Any, seed: Any) -> Any:
    """``(out [B, T, H, Dv], P [B, K, G, T, S] float32 before and after dropout, tanh of the soft cap or None)``."""
    b, t, h, d = q.shape
    kh, dv = k.shape[2], v.shape[-1]
    g = h // kh
    scores = jnp.einsum("btkgd,bskd->bkgts", q.reshape(b, t, kh, g, d), k, preferred_element_type=F32)
    scores = scores * F32(o.scale)
    if bias is not None:
        scores = scores + grouped(bias, kh, g).astype(F32)
    tanh = None
    if o.soft_cap is not None:
        tanh = jnp.tanh(scores / F32(o.soft_cap))
        scores = F32(o.soft_cap) * tanh
    if allowed is not None:
        scores = jnp.where(allowed, scores, -jnp.inf)
    # Softmax over the admitted keys. The row max only shifts the exponent (stop_gradient is exact); a
    # row that admits no key has max -inf, taken as 0 so that exp(-inf) = 0 gives P = 0, not NaN.
    row_max = lax.stop_gradient(scores.max(axis=-1, keepdims=True))
    e = jnp.exp(scores - jnp.where(row_max == -jnp.inf, 0.0, row_max))
    denom = e.sum(axis=-1, keepdims=True)
    p = e / jnp.where(denom == 0, 1.0, denom)
    pd = _dropout(o, seed, p)
    out = jnp.einsum("bkgts,bskd->btkgd", pd.astype(v.dtype), v, preferred_element_type=F32)
    return out.reshape(b, t, h, dv).astype(q.dtype), p, pd, tanh


def _dropout(o: DenseOptions, seed: Any, x: jax.Array) -> jax.Array:
    if o.dropout_prob == 0:
        return x
    keep = _keep(o, seed, *x.shape)
    return jnp.where(keep, x * F32(1.0 / (1.0 - o.dropout_prob)), 0.0)


def _results(o: DenseOptions, out: jax.Array, pd: jax.Array) -> Any:
    if not o.return_weights:
        return out
    b, k, g, t, s = pd.shape
    return out, pd.reshape(b, k * g, t, s)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention(o: DenseOptions, q, k, v, bias, allowed, seed):  # noqa: ANN001, ANN201
    """Dense attention; ``allowed`` is a boolean broadcastable to ``[B, K, G, T, S]`` or None (all admitted).

    Returns ``out`` or, with ``o.return_weights``, ``(out, weights [B, H, T, S] float32)``. Differentiable
    in ``q``, ``k``, ``v`` and ``bias``.
    """
    out, _, pd, _ = _forward(o, q, k, v, bias, allowed, seed)
    return _results(o, out, pd)


def _attention_fwd(o: DenseOptions, q, k, v, bias, allowed, seed):  # noqa: ANN001, ANN202
    out, p, pd, tanh = _forward(o, q, k, v, bias, allowed, seed)
    return _results(o, out, pd), (q, k, v, bias, allowed, seed, p, tanh)


def _attention_bwd(o: DenseOptions, res: Any, cotangent: Any) -> tuple[Any, ...]:
    q, k, v, bias, allowed, seed, p, tanh = res
    dout, dweights = cotangent if o.return_weights else (cotangent, None)
    b, t, h, d = q.shape
    kh, dv_dim = k.shape[2], v.shape[-1]
    g = h // kh
    dout = dout.astype(q.dtype).reshape(b, t, kh, g, dv_dim)
    dpd = jnp.einsum("btkgd,bskd->bkgts", dout, v, preferred_element_type=F32)
    if dweights is not None:
        dpd = dpd + dweights.astype(F32).reshape(dpd.shape)
    pd, dp = _dropout(o, seed, p), _dropout(o, seed, dpd)
    dv = jnp.einsum("bkgts,btkgd->bskd", pd.astype(dout.dtype), dout, preferred_element_type=F32)
    ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
    if tanh is not None:
        ds = ds * (1.0 - tanh * tanh)
    dbias = None
    if bias is not None:
        gb = grouped(bias, kh, g)
        axes = tuple(a for a in range(5) if gb.shape[a] == 1 and ds.shape[a] != 1)
        dbias = (ds.sum(axis=axes, keepdims=True) if axes else ds).reshape(bias.shape).astype(bias.dtype)
    ds = ds * F32(o.scale)
    dq = jnp.einsum("bkgts,bskd->btkgd", ds.astype(k.dtype), k, preferred_element_type=F32)
    dk = jnp.einsum("bkgts,btkgd->bskd", ds.astype(q.dtype), q.reshape(b, t, kh, g, d), preferred_element_type=F32)
    return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbias, None, None


attention.defvjp(_attention_fwd, _attention_bwd)
