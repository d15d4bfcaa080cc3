"""Reference ``grouped_matmul``: every row against every group's matrix, then each row keeps its own group's."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    transpose_rhs: bool = False,
    preferred_element_type: Any = None,
) -> jax.Array:
    """``out[i] = lhs[i] @ rhs[group of row i]``; rows past ``sum(group_sizes)`` give zeros. Computed in float32.

    >>> import jax.numpy as jnp
    >>> lhs = jnp.ones((4, 2)); rhs = jnp.stack([jnp.eye(2), 2 * jnp.eye(2)])
    >>> grouped_matmul(lhs, rhs, jnp.array([1, 2])).tolist()  # row 0: group 0, rows 1-2: group 1, row 3: none
    [[1.0, 1.0], [2.0, 2.0], [2.0, 2.0], [0.0, 0.0]]
    """
    acc = jnp.promote_types(jnp.float32, lhs.dtype)
    out_dtype = lhs.dtype if preferred_element_type is None else jnp.dtype(preferred_element_type)
    if transpose_rhs:
        rhs = jnp.swapaxes(rhs, 1, 2)  # [G, N, K] -> [G, K, N]
    m = lhs.shape[0]
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    rows = jnp.arange(m)
    member = ((rows[:, None] >= starts[None, :]) & (rows[:, None] < ends[None, :])).astype(acc)  # [M, G]
    per_group = jnp.einsum("mk,gkn->gmn", lhs.astype(acc), rhs.astype(acc), precision="highest")
    return jnp.einsum("mg,gmn->mn", member, per_group, precision="highest").astype(out_dtype)
