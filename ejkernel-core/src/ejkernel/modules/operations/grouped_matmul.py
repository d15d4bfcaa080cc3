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

The op is defined here once: this contract, ``validate``, the ``Kernel`` and the public function, whose
parameters are the canonical signature (``ejkernel.kernels.signatures.canonical_signature``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jaxtyping import Array, Float, Int

from ejkernel.kernels.signatures._checks import (
    FLOAT_DTYPES,
    ArrayIn,
    check_bool,
    check_float_array,
    check_same_dtype,
    describe,
    is_int_array,
    shape,
)
from ejkernel.modules.operations._dispatch import dispatch
from ejkernel.modules.operations._empty import zeros_if_empty
from ejkernel.modules.operations._typecheck import checked
from ejkernel.modules.operations.configs import GroupedMatmulConfig
from ejkernel.ops import Invocation, Kernel


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


class GroupedMatmul(Kernel[GroupedMatmulConfig]):
    op_id = "grouped_matmul"
    config_type = GroupedMatmulConfig

    def normalize(self, arguments: dict[str, Any]) -> dict[str, Any]:
        # jnp.float32, np.float32, "float32" are one option; the result dtype given as lhs's own is no option.
        name = canonical_dtype(arguments["preferred_element_type"])
        arguments["preferred_element_type"] = None if name == np.dtype(arguments["lhs"].dtype).name else name
        return arguments

    def make_inputs(self, inv: Invocation, seed: int = 0) -> dict[str, Any]:
        inputs = super().make_inputs(inv, seed)
        sizes = inv.arguments["group_sizes"]
        if isinstance(sizes, jax.ShapeDtypeStruct):
            # Every row in a group, the groups as even as the rows allow: representative work for timing.
            m, g = inv.arguments["lhs"].shape[0], sizes.shape[0]
            even = np.full(g, m // g, np.int64) + (np.arange(g) < m % g)
            inputs["group_sizes"] = jax.numpy.asarray(even, sizes.dtype)
        return inputs

    def empty_result(self, arguments: Mapping[str, Any]) -> Any:
        lhs, rhs = arguments["lhs"], arguments["rhs"]
        n = rhs.shape[1 if arguments["transpose_rhs"] else 2]
        dtype = arguments["preferred_element_type"] or lhs.dtype
        return zeros_if_empty((lhs.shape[0], n), dtype, lhs.shape[1] == 0)  # K == 0: empty sums


_kernel = GroupedMatmul()


@checked
def grouped_matmul(
    lhs: Float[ArrayIn, "M K"],
    rhs: Float[ArrayIn, "G _KN _NK"],  # [G, K, N], or [G, N, K] with transpose_rhs: not bound
    group_sizes: Int[ArrayIn, "G"],
    *,
    transpose_rhs: bool = False,
    preferred_element_type: Any = None,
    platform: str | None = None,
    backend: str | None = None,
    cfg: GroupedMatmulConfig | None = None,
    mesh: jax.sharding.Mesh | None = None,
    in_specs: Any = None,
    out_specs: Any = None,
) -> Float[Array, "M N"]:
    """Mixture-of-experts grouped matmul: consecutive groups of rows of ``lhs``, each times its own matrix.

    The semantics of ``jax.lax.ragged_dot``: rows ``[sum(group_sizes[:g]), sum(group_sizes[:g+1]))`` of
    ``lhs`` are multiplied by ``rhs[g]``; rows past ``sum(group_sizes)`` give zeros.

    Shapes: M rows, K contraction dim, N output columns, G groups.

    Args:
        lhs: ``[M, K]``, its rows sorted by group; differentiable.
        rhs: ``[G, K, N]`` (``[G, N, K]`` with ``transpose_rhs``), same dtype as ``lhs``; differentiable.
        group_sizes: ``[G]`` non-negative ints, rows per group (a group reaching past M is cut at M).
        transpose_rhs: ``rhs`` holds every group's matrix transposed, ``[G, N, K]``.
        preferred_element_type: the result dtype (e.g. ``jnp.float32`` for bfloat16 inputs); default
            ``lhs.dtype``. Products accumulate in float32 either way.
        platform: restrict to one kernel platform (``"xla"``, ...); default: any.
        backend: run for this backend (``"cpu"``, ``"gpu"``, ``"tpu"``); default: JAX's default device.
        cfg: a ``GroupedMatmulConfig`` that overrides the config chain (never cached); the XLA implementation
            reads its row tile from ``fwd_params.q_blocksize`` (and the backward's from ``bwd_params``).
        mesh, in_specs, out_specs: run under ``jax.shard_map``; ``in_specs`` has one spec per array passed.

    Returns:
        ``[M, N]`` in ``preferred_element_type`` (default ``lhs.dtype``).

    Raises:
        ValueError, TypeError: a bad shape, dtype or option (the message names it).
        ejkernel.ops.ConfigError: no installed implementation can serve the call (the message says why).

    Example:

    >>> import jax, jax.numpy as jnp
    >>> from ejkernel.modules import grouped_matmul
    >>> lhs = jax.random.normal(jax.random.key(0), (96, 32), jnp.bfloat16)
    >>> rhs = jax.random.normal(jax.random.key(1), (4, 32, 48), jnp.bfloat16)  # 4 experts
    >>> out = grouped_matmul(lhs, rhs, jnp.array([30, 0, 50, 10]), preferred_element_type=jnp.float32)
    >>> out.shape, out.dtype, bool((out[90:] == 0).all())  # the last 6 rows are in no group
    ((96, 48), dtype('float32'), True)
    """
    arrays = {"lhs": lhs, "rhs": rhs, "group_sizes": group_sizes}
    options = {"transpose_rhs": transpose_rhs, "preferred_element_type": preferred_element_type}
    return dispatch(
        _kernel,
        arrays,
        options,
        platform=platform,
        backend=backend,
        cfg=cfg,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
    )
