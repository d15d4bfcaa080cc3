"""The ``mean_pooling`` contract.

Shapes: B batch, T length, D features, N packed sequences.

Without ``cu_seqlens``: ``out[b] = mean(x[b, :T])``, ``[B, D]`` (zeros when T == 0).

With ``cu_seqlens`` (B == 1, ``[N+1]``, non-decreasing within ``[0, T]``): the sequences
``[cu_seqlens[n], cu_seqlens[n + 1])`` are packed along T and ``out[n]`` is the mean of sequence n,
``[N, D]``; an empty sequence gives zeros (never NaN) and tokens outside ``[cu_seqlens[0], cu_seqlens[N])``
count for nothing. Concrete ``cu_seqlens`` are checked (``ValueError``); under ``jit`` they are traced and
unchecked unless ``EJKERNEL_CHECKS=1`` (then the call fails when it runs), and offsets outside ``[0, T]`` or
decreasing give wrong means without an error.

The sums are accumulated in float32 and the result has ``x``'s dtype; it is differentiable in ``x``.

The op is defined here once: this contract, ``validate``, the ``Kernel`` and the public function, whose
parameters are the canonical signature (``ejkernel.kernels.signatures.canonical_signature``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jaxtyping import Array, Float, Int

from ejkernel.kernels.signatures._checks import ArrayIn, check_cu_seqlens, check_float_array
from ejkernel.modules.operations._dispatch import dispatch
from ejkernel.modules.operations._empty import zeros_if_empty
from ejkernel.modules.operations._typecheck import checked
from ejkernel.modules.operations.configs import MeanPoolingConfig
from ejkernel.ops import Invocation, Kernel


def validate(x: Any, *, cu_seqlens: Any = None, **_: Any) -> None:
    """Check a ``mean_pooling`` call; raise an error naming the argument, what was expected and what came."""
    b, t = check_float_array("mean_pooling", "x", x, "[B, T, D]")[:2]
    if cu_seqlens is not None:
        check_cu_seqlens("mean_pooling", "cu_seqlens", cu_seqlens, b, t)


class MeanPooling(Kernel[MeanPoolingConfig]):
    op_id = "mean_pooling"
    config_type = MeanPoolingConfig

    def make_inputs(self, inv: Invocation, seed: int = 0) -> dict[str, Any]:
        inputs = super().make_inputs(inv, seed)
        cu = inv.arguments.get("cu_seqlens")
        if isinstance(cu, jax.ShapeDtypeStruct):
            # Packed sequences of equal length: representative work for timing.
            n, t = cu.shape[0] - 1, inv.arguments["x"].shape[1]
            inputs["cu_seqlens"] = jax.numpy.asarray(np.linspace(0, t, n + 1).astype(np.int64), cu.dtype)
        return inputs

    def empty_result(self, arguments: Mapping[str, Any]) -> Any:
        x, cu = arguments["x"], arguments["cu_seqlens"]
        b, t, d = x.shape
        return zeros_if_empty((b if cu is None else cu.shape[0] - 1, d), x.dtype, t == 0)  # T == 0: zeros


_kernel = MeanPooling()


@checked
def mean_pooling(
    x: Float[ArrayIn, "B T D"],
    *,
    cu_seqlens: Int[ArrayIn, "N1"] | None = None,
    platform: str | None = None,
    backend: str | None = None,
    cfg: MeanPoolingConfig | None = None,
    mesh: jax.sharding.Mesh | None = None,
    in_specs: Any = None,
    out_specs: Any = None,
) -> Float[Array, "B_or_N D"]:
    """The mean over time of every batch row, or of every packed sequence, accumulated in float32.

    Shapes: B batch, T length, D features, N packed sequences.

    Args:
        x: ``[B, T, D]``; differentiable.
        cu_seqlens: ``[N+1]`` offsets of sequences packed along T (B must be 1); tokens outside
            ``[cu_seqlens[0], cu_seqlens[N])`` count for nothing.
        platform: restrict to one kernel platform (``"xla"``, ...); default: any.
        backend: run for this backend (``"cpu"``, ``"gpu"``, ``"tpu"``); default: JAX's default device.
        cfg: a ``MeanPoolingConfig`` that overrides the config chain (never cached).
        mesh, in_specs, out_specs: run under ``jax.shard_map``; ``in_specs`` has one spec per array passed.

    Returns:
        ``[B, D]`` (``[N, D]`` with ``cu_seqlens``) in ``x.dtype``; an empty sequence gives zeros.

    Raises:
        ValueError, TypeError: a bad shape, dtype or option (the message names it).
        ejkernel.ops.ConfigError: no installed implementation can serve the call (the message says why).

    Example:

    >>> import jax.numpy as jnp
    >>> from ejkernel.modules import mean_pooling
    >>> x = jnp.arange(12.0).reshape(1, 6, 2)
    >>> mean_pooling(x).tolist()
    [[5.0, 6.0]]
    >>> mean_pooling(x, cu_seqlens=jnp.array([0, 2, 2, 6])).tolist()  # the middle sequence is empty
    [[1.0, 2.0], [0.0, 0.0], [7.0, 8.0]]
    """
    return dispatch(
        _kernel,
        {"x": x, "cu_seqlens": cu_seqlens},
        {},
        platform=platform,
        backend=backend,
        cfg=cfg,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
    )
