"""Reference ``gla``: the gated linear-attention recurrence, token by token, in float32."""

from __future__ import annotations

import jax

from ejkernel.testing.reference._linear_attention import linear_recurrence, per_value_head


def gla(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    cu_seqlens: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """``S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t``, ``o_t = scale q_t S_t`` (contract: ``ejkernel.modules.operations.gla``).

    Per value head: ``v`` ``[B, T, HV, V]``, ``g`` ``[B, T, HV, K]``; value head ``hv`` reads query/key head
    ``hv // (HV // H)`` of ``q``, ``k`` ``[B, T, H, K]``.

    >>> import jax.numpy as jnp
    >>> q = k = jnp.ones((1, 2, 1, 1)); v = jnp.array([1.0, 2.0]).reshape(1, 2, 1, 1)
    >>> g = jnp.log(jnp.full((1, 2, 1, 1), 0.5))  # the state halves every step
    >>> o, s = gla(q, k, v, g, scale=1.0, output_final_state=True)
    >>> o[0, :, 0, 0].tolist(), s[0, 0].tolist()  # 1, then 0.5 * 1 + 2
    ([1.0, 2.5], [[2.5]])
    """
    q, k = per_value_head(q, k, v.shape[2])
    return linear_recurrence(
        q,
        k,
        v,
        log_decay_k=g,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )
