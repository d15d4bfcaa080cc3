"""``BaseOperationConfig``: what the chain resolves for one call (which implementation, which launch parameters)."""

from __future__ import annotations

import dataclasses
from typing import Any, Self

from ejkernel.kernels._types import check_backend
from ejkernel.kernels.params import LaunchParams
from ejkernel.ops.utils.datacarrier import BwdParams, FwdParams


def _class_ref(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _load_class(ref: str) -> type[LaunchParams]:
    import importlib

    module, _, name = ref.partition(":")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, LaunchParams)):
        raise TypeError(f"{ref!r} is not a LaunchParams class")
    return obj


@dataclasses.dataclass(frozen=True)
class BaseOperationConfig:
    """Which implementation runs an op and with which launch parameters.

    ``platform``/``backend`` ``"auto"`` let the chain choose; ``platform`` may also name one implementation
    (``"cudnn"``) or say ``"platform:backend"``. ``fwd_params``/``bwd_params`` ``None`` mean the
    implementation's heuristic; otherwise the chosen implementation's own launch-parameter classes, or the
    generic ``FwdParams``/``BwdParams`` that it maps onto its own (an implementation refuses params of
    another's class, naming it). Frozen and hashable, so it can be a static argument.

    >>> from ejkernel.modules.operations.configs import FlashAttentionConfig
    >>> from ejkernel.ops.utils.datacarrier import FwdParams
    >>> cfg = FlashAttentionConfig(platform="xla", fwd_params=FwdParams(kv_blocksize=256))
    >>> FlashAttentionConfig.from_dict(cfg.to_dict()) == cfg
    True
    """

    platform: str = "auto"
    backend: str = "auto"
    fwd_params: LaunchParams | None = None
    bwd_params: LaunchParams | None = None

    def __post_init__(self) -> None:
        # Accept Platform/Backend enums and plain strings alike; store plain lower-case strings.
        object.__setattr__(self, "platform", str(getattr(self.platform, "value", self.platform)).lower())
        object.__setattr__(self, "backend", check_backend(self.backend, f"{type(self).__name__}: backend"))
        for stage in ("fwd_params", "bwd_params"):
            value = getattr(self, stage)
            if value is not None and not isinstance(value, LaunchParams):
                raise TypeError(
                    f"{type(self).__name__}: {stage} must be launch parameters (FwdParams, BwdParams or an "
                    f"implementation's own LaunchParams class) or None, got {type(value).__name__}"
                )

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"platform": self.platform, "backend": self.backend}
        for stage, generic in (("fwd_params", FwdParams), ("bwd_params", BwdParams)):
            value = getattr(self, stage)
            if value is not None:
                d[stage] = value.to_dict()
                if type(value) is not generic:
                    d[f"{stage}_class"] = _class_ref(type(value))
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        data = dict(data)
        for stage, generic in (("fwd_params", FwdParams), ("bwd_params", BwdParams)):
            ref = data.pop(f"{stage}_class", None)
            if data.get(stage) is not None:
                params_cls = generic if ref is None else _load_class(ref)
                data[stage] = params_cls.from_dict(data[stage])
        return cls(**data)
