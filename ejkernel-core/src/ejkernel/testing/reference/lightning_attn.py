"""Reference ``lightning_attn``: linear attention whose state decays by ``exp(-slope[h])`` per step."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ejkernel.testing.reference._linear_attention import linear_recurrence


def lightning_attn(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slope: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    cu_seqlens: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """``S_t = exp(-slope[h]) S_{t-1} + k_t^T v_t``, ``o_t = scale q_t S_t`` (contract: ``ejkernel.modules.operations.lightning_attn``).

    >>> import jax.numpy as jnp
    >>> q = k = jnp.ones((1, 3, 1, 1)); v = jnp.ones((1, 3, 1, 1))
    >>> o, _ = lightning_attn(q, k, v, jnp.array([0.0]), scale=1.0)  # no decay: a running sum
    >>> o[0, :, 0, 0].tolist()
    [1.0, 2.0, 3.0]
    """
    b, t, h, _ = q.shape
    log_decay = jnp.broadcast_to(-slope.astype(jnp.promote_types(jnp.float32, slope.dtype))[:, None], (b, t, h, 1))
    return linear_recurrence(
        q,
        k,
        v,
        log_decay_k=log_decay,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )
