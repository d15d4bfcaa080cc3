"""The recurrence shared by the linear-attention references (``gla``, ``lightning_attn``, ``recurrent``).

Token by token, exactly as the contracts state it: no chunking, no rearranged sums. ``per_value_head`` is the
grouping of value heads shared by the ``gla`` and ``gated_delta_rule`` references.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def per_value_head(q: jax.Array, k: jax.Array, value_heads: int) -> tuple[jax.Array, jax.Array]:
    """Grouped value heads: ``q``, ``k`` ``[B, T, H, K]`` as each of the ``HV = value_heads`` value heads reads
    them, ``[B, T, HV, K]``: value head ``hv`` reads query/key head ``hv // (HV // H)``.

    >>> q = jnp.arange(2.0).reshape(1, 1, 2, 1)  # two query/key heads, holding 0 and 1
    >>> per_value_head(q, q, 4)[0][0, 0, :, 0].tolist()  # four value heads: 0 and 1 read head 0, 2 and 3 head 1
    [0.0, 0.0, 1.0, 1.0]
    """
    group = value_heads // q.shape[2]
    head = jnp.arange(value_heads) // group
    return q[:, :, head], k[:, :, head]


def linear_recurrence(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    log_decay_k: jax.Array | None = None,
    log_decay_v: jax.Array | None = None,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    cu_seqlens: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """``S_t = diag(exp(log_decay_k,t)) S_{t-1} diag(exp(log_decay_v,t)) + k_t^T v_t``, ``o_t = scale q_t S_t``.

    ``log_decay_k`` is ``[B, T, H, K]`` or ``[B, T, H, 1]`` (one decay for the whole state),
    ``log_decay_v`` ``[B, T, H, V]``; absent means no decay. The other arguments are the contracts'.
    Returns ``(o in q's dtype, final state in float32 or None)``.
    """
    in_dtype, acc = q.dtype, jnp.promote_types(jnp.float32, q.dtype)
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    scale = dk**-0.5 if scale is None else scale
    q, k, v = (x.astype(acc) for x in (q, k, v))
    a = jnp.zeros((b, t, h, 1), acc) if log_decay_k is None else log_decay_k.astype(acc)
    c = jnp.zeros((b, t, h, 1), acc) if log_decay_v is None else log_decay_v.astype(acc)

    # Which sequence every token belongs to, whether it is inside one, and whether it is the first
    # token its sequence visits (there the state restarts from that sequence's initial state).
    pos = jnp.arange(t)
    if cu_seqlens is None:
        n_seq = b
        seq = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
        inside = jnp.ones((b, t), bool)
        first = jnp.broadcast_to(pos == (t - 1 if reverse else 0), (b, t))
    else:
        n_seq = cu_seqlens.shape[0] - 1
        s = jnp.clip(jnp.searchsorted(cu_seqlens, pos, side="right") - 1, 0, n_seq - 1)
        inside = (pos >= cu_seqlens[0]) & (pos < cu_seqlens[n_seq])
        first_pos = cu_seqlens[s + 1] - 1 if reverse else cu_seqlens[s]
        seq, inside, first = s[None], inside[None], (pos == first_pos)[None]
    h0 = jnp.zeros((n_seq, h, dk, dv), acc) if initial_state is None else initial_state.astype(acc)

    def step(state: jax.Array, x: tuple[jax.Array, ...]) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        q_t, k_t, v_t, a_t, c_t, seq_t, inside_t, first_t = x  # [B, H, ...] and [B]
        state = jnp.where(first_t[:, None, None, None], h0[seq_t], state)
        state = jnp.exp(a_t)[..., :, None] * state * jnp.exp(c_t)[..., None, :]
        state = state + k_t[..., :, None] * v_t[..., None, :]
        o_t = scale * jnp.einsum("bhk,bhkv->bhv", q_t, state, precision="highest")
        return state, (jnp.where(inside_t[:, None, None], o_t, 0.0), state)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, a, c, seq, inside, first))
    state0 = jnp.zeros((b, h, dk, dv), acc)
    last, (o, states) = lax.scan(step, state0, xs, reverse=reverse)
    out = jnp.moveaxis(o, 0, 1).astype(in_dtype)
    if not output_final_state:
        return out, None
    if cu_seqlens is None:
        return out, last
    # The state after the last token each sequence visits; an empty sequence keeps its initial state.
    start, end = cu_seqlens[:-1], cu_seqlens[1:]
    last_pos = jnp.clip(start if reverse else end - 1, 0, t - 1)
    final = jnp.where((end > start)[:, None, None, None], states[last_pos, 0], h0)
    return out, final
