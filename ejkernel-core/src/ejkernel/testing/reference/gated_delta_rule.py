"""Reference ``gated_delta_rule``: the recurrence itself, one token at a time, in float32 (float64 where enabled)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.testing.reference._linear_attention import per_value_head


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``x / sqrt(|x|^2 + eps)`` over the last axis (the ``use_qk_l2norm`` normalisation)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    cu_seqlens: jax.Array | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """The gated delta rule of ``ejkernel.kernels`` ``gated_delta_rule``, step by step.

    ``q``, ``k`` ``[B, T, H, K]``; ``v`` ``[B, T, HV, V]``, ``g`` and ``beta`` ``[B, T, HV]``: value head ``hv``
    reads query/key head ``hv // (HV // H)``. Returns ``(o [B, T, HV, V] in q.dtype, final_state [B|N, HV, K, V]
    in float32 or None)``.

    >>> import jax.numpy as jnp
    >>> q = k = jnp.ones((1, 1, 1, 1)); v = jnp.full((1, 1, 1, 1), 3.0)
    >>> g = jnp.zeros((1, 1, 1)); beta = jnp.full((1, 1, 1), 0.5)
    >>> o, s = gated_delta_rule(q, k, v, g, beta, scale=1.0, output_final_state=True)
    >>> float(o[0, 0, 0, 0]), float(s[0, 0, 0, 0])  # S = 0 + 0.5 * 1 * (3 - 0) = 1.5
    (1.5, 1.5)
    """
    out_dtype = q.dtype
    acc = jnp.promote_types(jnp.float32, out_dtype)
    b, t, _, dk = q.shape
    h, dv = v.shape[2:]  # the value heads: every one has its own state
    scale = dk**-0.5 if scale is None else scale
    q, k = per_value_head(q, k, h)
    q, k, v, g, beta = (x.astype(acc) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    n = b if cu_seqlens is None else cu_seqlens.shape[0] - 1
    s0 = jnp.zeros((n, h, dk, dv), acc) if initial_state is None else initial_state.astype(acc)

    # Which sequence every token belongs to, and whether it is the first of it (where the state restarts).
    # Without cu_seqlens every batch row is one sequence that starts at t = 0.
    pos = jnp.arange(t)
    if cu_seqlens is None:
        seq = jnp.zeros((t,), jnp.int32)
        starts = pos == 0
        inside = jnp.ones((t,), bool)
    else:
        seq = jnp.clip(jnp.searchsorted(cu_seqlens, pos, side="right") - 1, 0, n - 1)
        starts = pos == cu_seqlens[seq]
        inside = (pos >= cu_seqlens[0]) & (pos < cu_seqlens[n])

    def step(state: jax.Array, x: Any) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        # state: [B, HV, K, V]; x: one token of every batch row.
        q_t, k_t, v_t, g_t, beta_t, seq_t, start_t = x
        first = s0[seq_t][None] if cu_seqlens is not None else s0
        state = jnp.where(start_t, first, state)
        state = state * jnp.exp(g_t)[..., None, None]  # decay
        read = jnp.einsum("bhkv,bhk->bhv", state, k_t, precision="highest")  # what the state holds for k_t
        delta = beta_t[..., None] * (v_t - read)
        state = state + jnp.einsum("bhk,bhv->bhkv", k_t, delta, precision="highest")
        o_t = scale * jnp.einsum("bhkv,bhk->bhv", state, q_t, precision="highest")
        return state, (o_t, state)

    xs = (*(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta)), seq, starts)
    init = s0 if cu_seqlens is None else jnp.zeros((1, h, dk, dv), acc)
    _, (o, states) = jax.lax.scan(step, init, xs)  # o: [T, B, HV, V]; states: [T, B, HV, K, V]
    o = jnp.where(inside[:, None, None, None], o, 0.0)
    o = jnp.moveaxis(o, 0, 1).astype(out_dtype)
    if not output_final_state:
        return o, None
    if cu_seqlens is None:
        return o, states[-1]
    # The state after the last token of each sequence; an empty sequence keeps its initial state.
    last = jnp.clip(cu_seqlens[1:] - 1, 0, t - 1)
    final = jnp.where((cu_seqlens[1:] > cu_seqlens[:-1])[:, None, None, None], states[last, 0], s0)
    return o, final
