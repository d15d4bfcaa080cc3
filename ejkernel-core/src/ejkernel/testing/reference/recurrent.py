"""Reference ``recurrent``: the general gated linear-attention recurrence, token by token, in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ejkernel.testing.reference._linear_attention import linear_recurrence


def recurrent(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array | None = None,
    g_k: jax.Array | None = None,
    g_v: jax.Array | None = None,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    cu_seqlens: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """``S_t = exp(g_t) diag(exp(g_k,t)) S_{t-1} diag(exp(g_v,t)) + k_t^T v_t``, ``o_t = scale q_t S_t``.

    The contract is ``ejkernel.modules.operations.recurrent``; ``reverse`` visits the tokens from last to first.

    >>> import jax.numpy as jnp
    >>> q = k = jnp.ones((1, 3, 1, 1)); v = jnp.array([1.0, 2.0, 3.0]).reshape(1, 3, 1, 1)
    >>> recurrent(q, k, v, scale=1.0)[0][0, :, 0, 0].tolist()  # sums of v[:t+1]
    [1.0, 3.0, 6.0]
    >>> recurrent(q, k, v, scale=1.0, reverse=True)[0][0, :, 0, 0].tolist()  # sums of v[t:]
    [6.0, 5.0, 3.0]
    """
    acc = jnp.promote_types(jnp.float32, q.dtype)
    log_decay_k = None
    if g is not None:
        log_decay_k = g.astype(acc)[..., None]
    if g_k is not None:
        log_decay_k = g_k.astype(acc) if log_decay_k is None else log_decay_k + g_k.astype(acc)
    return linear_recurrence(
        q,
        k,
        v,
        log_decay_k=log_decay_k,
        log_decay_v=g_v,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        reverse=reverse,
        cu_seqlens=cu_seqlens,
    )
