"""``lightning_attn`` and ``recurrent`` on the ``gla`` kernels (fused recurrent or chunked): their gates become
``gla``'s key-side log decay, and ``reverse`` becomes a flip of the time axis.

``recurrent``'s ``S_t = exp(g_t) diag(exp(g_k,t)) S_{t-1} diag(exp(g_v,t)) + k_t^T v_t`` is ``gla`` with ``g_t +
g_k,t`` as its per-key log decay (and, in the fused recurrent kernel, ``g_v,t`` as a per-value one), and
``lightning_attn``'s per-head decay ``exp(-slope[h])`` is ``gla`` with ``-slope[h]`` on every key channel. Without a
key or value gate both have one log decay per token and head, ``[B, T, H]``: the chunked modules run it on
``simple_gla`` (``ejkernel_triton._simple_chunk``), the fused recurrent kernel reads it as such (``GATE_K`` off). ``reverse=True`` visits tokens from last to first with the
same per-token decay, so it is the forward recurrence of the flipped sequence: packed sequences (``cu_seqlens``) are
flipped as a whole (their order reverses, so the initial and final states' rows are flipped too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def slope_scalar_decay(q: jax.Array, slope: jax.Array) -> jax.Array:
    """``-slope[h]`` broadcast to ``[B, T, H]`` float32: one log decay per token and head (``simple_gla``'s)."""
    return jnp.broadcast_to(-jnp.asarray(slope).astype(jnp.float32), jnp.shape(q)[:3])


def scalar_decay(q: jax.Array, g: jax.Array | None) -> jax.Array:
    """``g [B, T, H]`` as float32 (zeros when absent): one log decay per token and head (``simple_gla``'s)."""
    return jnp.zeros(jnp.shape(q)[:3], jnp.float32) if g is None else jnp.asarray(g).astype(jnp.float32)


def recurrent_log_decay(q: jax.Array, g: jax.Array | None, g_k: jax.Array | None) -> jax.Array:
    """``g[..., None] + g_k`` as ``[B, T, H, K]`` float32 (zeros for absent gates)."""
    out = jnp.zeros(jnp.shape(q), jnp.float32)
    if g is not None:
        out = out + jnp.asarray(g).astype(jnp.float32)[..., None]
    if g_k is not None:
        out = out + jnp.asarray(g_k).astype(jnp.float32)
    return out


def call_gla(
    gla: Callable[..., tuple[jax.Array, jax.Array | None]],
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    log_decay: jax.Array,
    *,
    log_decay_v: jax.Array | None = None,
    reverse: bool = False,
    initial_state: jax.Array | None = None,
    cu_seqlens: jax.Array | None = None,
    **options: Any,
) -> tuple[jax.Array, jax.Array | None]:
    """``gla(q, k, v, log_decay, ...)``, the tokens visited backwards when ``reverse`` (see the module). ``gla``:
    any callable of ``gla``'s signature whose fourth argument is a log decay with a time axis 1 (``[B, T, H, K]``,
    ``[B, T, H]`` for ``simple_gla``, ``[B, T, H, V]`` for ``value_gla``). A value gate ``log_decay_v`` goes to
    ``gla`` as its second gate (the fused recurrent kernel's; ``value_gla`` takes its one gate as ``log_decay``)."""
    if log_decay_v is not None:
        options["g_v"] = jnp.flip(jnp.asarray(log_decay_v), axis=1) if reverse else log_decay_v
    if not reverse:
        return gla(q, k, v, log_decay, initial_state=initial_state, cu_seqlens=cu_seqlens, **options)
    q, k, v, log_decay = (jnp.flip(jnp.asarray(x), axis=1) for x in (q, k, v, log_decay))
    packed = cu_seqlens is not None
    if packed:
        cu_seqlens = jnp.shape(q)[1] - jnp.flip(jnp.asarray(cu_seqlens))
        initial_state = None if initial_state is None else jnp.flip(jnp.asarray(initial_state), axis=0)
    o, final = gla(q, k, v, log_decay, initial_state=initial_state, cu_seqlens=cu_seqlens, **options)
    if packed and final is not None:
        final = jnp.flip(final, axis=0)
    return jnp.flip(o, axis=1), final
