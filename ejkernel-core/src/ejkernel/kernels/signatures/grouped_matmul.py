"""The ``grouped_matmul`` contract (the mixture-of-experts grouped matmul; the semantics of ``jax.lax.ragged_dot``).

Shapes: M rows, K contraction dim, N output columns, G groups.

The rows of ``lhs`` are split into G consecutive groups: with ``ends = cumsum(group_sizes)`` and
``starts = ends - group_sizes``, row ``i`` belongs to group ``g`` when ``starts[g] <= i < ends[g]``, and

    ``out[i] = lhs[i] @ rhs[g]``   (``rhs[g]`` is ``[K, N]``; with ``transpose_rhs`` it is ``[N, K]`` and
    ``out[i] = lhs[i] @ rhs[g].T``).

Rows past ``sum(group_sizes)`` belong to no group and give zeros; a group that reaches past row M is cut
at M (as ``jax.lax.ragged_dot``). An empty group contributes nothing and its ``rhs[g]`` gets a zero
gradient. ``group_sizes`` must be non-negative (what negative sizes give is unspecified); their values are
data, so none of this is checked at trace time.

Products are accumulated in float32; the result has dtype ``preferred_element_type`` when given, else
``lhs.dtype``. Differentiable in ``lhs`` and ``rhs`` (the gradients have their dtypes).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jaxtyping import Array, Float, Int

from ejkernel.kernels.params import BwdParams, FwdParams
from ejkernel.kernels.signatures._checks import (
    FLOAT_DTYPES,
    check_bool,
    check_float_array,
    check_same_dtype,
    describe,
    is_int_array,
    shape,
)


def grouped_matmul(
    lhs: Float[Array, "M K"],
    rhs: Float[Array, "G K N"],
    group_sizes: Int[Array, "G"],
    *,
    transpose_rhs: bool = False,
    preferred_element_type: Any = None,
    fwd_params: FwdParams | None = None,
    bwd_params: BwdParams | None = None,
) -> Float[Array, "M N"]:
    """Canonical signature of ``grouped_matmul`` (see the module docstring for the semantics).

    ``rhs`` is ``[G, N, K]`` when ``transpose_rhs``; ``preferred_element_type`` is a float dtype or None.
    """
    raise NotImplementedError


def canonical_dtype(preferred_element_type: Any) -> str | None:
    """``preferred_element_type`` as a dtype name (``jnp.float32``, ``"float32"``, ... -> ``"float32"``), or None.

    Raises:
        TypeError: it names no dtype.
    """
    if preferred_element_type is None:
        return None
    try:
        return str(np.dtype(preferred_element_type))
    except TypeError:
        raise TypeError(
            f"grouped_matmul: preferred_element_type must be a float dtype or None, got {preferred_element_type!r}"
        ) from None


def validate(
    lhs: Any,
    rhs: Any,
    group_sizes: Any,
    *,
    transpose_rhs: bool = False,
    preferred_element_type: Any = None,
    **_: Any,
) -> None:
    """Check a ``grouped_matmul`` call; raise an error naming the argument, what was expected and what came."""
    k = check_float_array("grouped_matmul", "lhs", lhs, "[M, K]")[1]
    layout = "[G, N, K]" if transpose_rhs else "[G, K, N]"
    rhs_shape = check_float_array("grouped_matmul", "rhs", rhs, layout)
    check_same_dtype("grouped_matmul", {"lhs": lhs, "rhs": rhs})
    check_bool("grouped_matmul", "transpose_rhs", transpose_rhs)
    if rhs_shape[2 if transpose_rhs else 1] != k:
        raise ValueError(
            f"grouped_matmul: rhs must be {layout} with K = {k} (lhs's last dim), got shape {list(rhs_shape)}"
        )
    g = rhs_shape[0]
    if g == 0:
        raise ValueError(f"grouped_matmul: rhs must have at least one group, got shape {list(rhs_shape)}")
    if shape(group_sizes) != (g,) or not is_int_array(group_sizes):
        raise ValueError(
            f"grouped_matmul: group_sizes must be a 1-D integer array [G] = [{g}] (rhs's groups), "
            f"got {describe(group_sizes)}"
        )
    result = canonical_dtype(preferred_element_type)
    if result is not None and result not in FLOAT_DTYPES:
        raise TypeError(
            f"grouped_matmul: preferred_element_type must be float32, bfloat16, float16 or None, got {result}"
        )
