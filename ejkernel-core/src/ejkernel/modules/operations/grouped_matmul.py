"""``grouped_matmul``: the public function and its operations-layer ``Kernel``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jaxtyping import Array, Float, Int

from ejkernel.kernels.signatures.grouped_matmul import canonical_dtype
from ejkernel.modules.operations._dispatch import dispatch
from ejkernel.modules.operations._empty import zeros_if_empty
from ejkernel.modules.operations.configs import GroupedMatmulConfig
from ejkernel.ops import Invocation, Kernel


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


def grouped_matmul(
    lhs: Float[Array, "M K"],
    rhs: Float[Array, "G K N"],
    group_sizes: Int[Array, "G"],
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
