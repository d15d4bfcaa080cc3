"""What every public op function does with its arguments: shard (when asked), then run through the executor."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ejkernel.modules.operations._sharding import maybe_shard_map
from ejkernel.ops import Executor, Kernel
from ejkernel.ops.config.base import BaseOperationConfig

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

    With ``mesh``, the call runs under ``jax.shard_map`` (see ``maybe_shard_map``).
    """
    return maybe_shard_map(
        kernel.op_id,
        lambda **kw: _executor(kernel, cfg=cfg, platform=platform, backend=backend, **kw),
        arrays,
        options,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
    )
