"""What every public op function does with its arguments: shard (when asked), then run through the executor."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ejkernel.modules.operations._sharding import maybe_shard_map
from ejkernel.ops import Executor, Kernel
from ejkernel.ops.config.base import BaseOperationConfig
from ejkernel.ops.invocation import is_array

_executor = Executor()


def dispatch(
    kernel: Kernel[Any],
    arrays: Mapping[str, Any],
    options: Mapping[str, Any],
    *,
    platform: str | None,
    backend: str | None,
    cfg: BaseOperationConfig | None,
    mesh: Any,
    in_specs: Any,
    out_specs: Any,
) -> Any:
    """Run ``kernel`` on ``arrays`` (traced; ``None`` for absent optional arrays) and ``options`` (static).

    With ``mesh``, the call runs under ``jax.shard_map`` (see ``maybe_shard_map``). A call with a zero-size
    array gives ``kernel.empty_result`` when that has one (per shard under a mesh), without an implementation.
    """

    def run(**kw: Any) -> Any:
        if any(is_array(v) and 0 in np.shape(v) for v in kw.values()):
            arguments = kernel.bind((), kw)
            kernel.validate(arguments)
            empty = kernel.empty_result(kernel.normalize(arguments))
            if empty is not None:
                return empty
        return _executor(kernel, cfg=cfg, platform=platform, backend=backend, **kw)

    return maybe_shard_map(
        kernel.op_id,
        run,
        arrays,
        options,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
    )
