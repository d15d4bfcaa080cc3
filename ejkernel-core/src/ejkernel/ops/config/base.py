"""``BaseOperationConfig``: what the chain resolves for one call (which implementation, which launch parameters)."""

from __future__ import annotations

import dataclasses
from typing import Any, Self

from ejkernel.kernels._types import check_backend
from ejkernel.ops.utils.datacarrier import BwdParams, FwdParams


@dataclasses.dataclass(frozen=True)
class BaseOperationConfig:
    """Which implementation runs an op and with which launch parameters.

    ``platform``/``backend`` ``"auto"`` let the chain choose; ``fwd_params``/``bwd_params`` ``None``
    mean the implementation's heuristic. Frozen and hashable, so it can be a static argument.

    >>> from ejkernel.modules.operations.configs import FlashAttentionConfig
    >>> from ejkernel.ops.utils.datacarrier import FwdParams
    >>> cfg = FlashAttentionConfig(platform="xla", fwd_params=FwdParams(kv_blocksize=256))
    >>> FlashAttentionConfig.from_dict(cfg.to_dict()) == cfg
    True
    """

    platform: str = "auto"
    backend: str = "auto"
    fwd_params: FwdParams | None = None
    bwd_params: BwdParams | None = None

    def __post_init__(self) -> None:
        # Accept Platform/Backend enums and plain strings alike; store plain lower-case strings.
        object.__setattr__(self, "platform", str(getattr(self.platform, "value", self.platform)).lower())
        object.__setattr__(self, "backend", check_backend(self.backend, f"{type(self).__name__}: backend"))
        if self.fwd_params is not None and not isinstance(self.fwd_params, FwdParams):
            raise TypeError(
                f"{type(self).__name__}: fwd_params must be FwdParams or None, got {type(self.fwd_params).__name__}"
            )
        if self.bwd_params is not None and not isinstance(self.bwd_params, BwdParams):
            raise TypeError(
                f"{type(self).__name__}: bwd_params must be BwdParams or None, got {type(self.bwd_params).__name__}"
            )

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"platform": self.platform, "backend": self.backend}
        if self.fwd_params is not None:
            d["fwd_params"] = self.fwd_params.to_dict()
        if self.bwd_params is not None:
            d["bwd_params"] = self.bwd_params.to_dict()
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        data = dict(data)
        if data.get("fwd_params") is not None:
            data["fwd_params"] = FwdParams.from_dict(data["fwd_params"])
        if data.get("bwd_params") is not None:
            data["bwd_params"] = BwdParams.from_dict(data["bwd_params"])
        return cls(**data)
