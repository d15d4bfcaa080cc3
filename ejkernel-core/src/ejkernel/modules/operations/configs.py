"""Per-op config dataclasses (``cfg=`` of the public functions)."""

from __future__ import annotations

import dataclasses

from ejkernel.ops.config.base import BaseOperationConfig


@dataclasses.dataclass(frozen=True)
class FlashAttentionConfig(BaseOperationConfig):
    """Config of ``flash_attention``: ``platform``, ``backend``, ``fwd_params``, ``bwd_params``."""


__all__ = ["BaseOperationConfig", "FlashAttentionConfig"]
