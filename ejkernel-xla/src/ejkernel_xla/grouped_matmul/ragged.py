"""``grouped_matmul`` on ``jax.lax.ragged_dot``: for TPU, where XLA lowers it to its native grouped matmul.

Elsewhere ``ragged_dot``'s generic lowering masks a copy of ``lhs`` per group (``G x M x K``), so the tiled
implementation (``interface``) serves CPU and GPU. Gradients are ``ragged_dot``'s own (``d rhs`` is a
ragged-contracting ``ragged_dot_general``). There are no launch parameters (``NoParams``).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ejkernel.modules.operations.grouped_matmul import canonical_dtype

# lhs [M, K] x rhs [G, N, K] contracting K, rows of lhs ragged over the groups of rhs
_TRANSPOSED = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)


def grouped_matmul(
    lhs, rhs, group_sizes, *, transpose_rhs=False, preferred_element_type=None, fwd_params=None, bwd_params=None
):  # fmt: skip
    """Grouped matmul through ``jax.lax.ragged_dot`` (contract: ``ejkernel.modules.operations.grouped_matmul``).

    Accumulates in float32 (``preferred_element_type=float32``), then casts to the result dtype.
    """
    out_dtype = canonical_dtype(preferred_element_type) or jnp.dtype(lhs.dtype).name
    group_sizes = group_sizes.astype(jnp.int32)
    if transpose_rhs:
        out = lax.ragged_dot_general(lhs, rhs, group_sizes, _TRANSPOSED, preferred_element_type=jnp.float32)
    else:
        out = lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


__all__ = ["grouped_matmul"]
