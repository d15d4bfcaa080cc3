"""Per-op config dataclasses (``cfg=`` of the public functions).

Each holds ``platform``, ``backend``, ``fwd_params`` and ``bwd_params`` (see ``BaseOperationConfig``);
an op whose implementations take other launch parameters says so in its docstring.
"""

from __future__ import annotations

import dataclasses

from ejkernel.ops.config.base import BaseOperationConfig


@dataclasses.dataclass(frozen=True)
class FlashAttentionConfig(BaseOperationConfig):
    """Config of ``flash_attention``: ``platform``, ``backend``, ``fwd_params``, ``bwd_params``."""


@dataclasses.dataclass(frozen=True)
class AttentionConfig(BaseOperationConfig):
    """Config of ``attention``: ``platform``, ``backend``, ``fwd_params``, ``bwd_params``."""


@dataclasses.dataclass(frozen=True)
class ScaledDotProductAttentionConfig(BaseOperationConfig):
    """Config of ``scaled_dot_product_attention``: ``platform``, ``backend``, ``fwd_params``, ``bwd_params``."""


@dataclasses.dataclass(frozen=True)
class RingAttentionConfig(BaseOperationConfig):
    """Config of ``ring_attention``: ``platform``, ``backend``, ``fwd_params``, ``bwd_params``."""


@dataclasses.dataclass(frozen=True)
class PageAttentionConfig(BaseOperationConfig):
    """Config of ``page_attention``: ``platform``, ``backend``, ``fwd_params``, ``bwd_params``."""


@dataclasses.dataclass(frozen=True)
class RaggedPageAttentionConfig(BaseOperationConfig):
    """Config of ``ragged_page_attention``: ``platform``, ``backend``, ``fwd_params``, ``bwd_params``."""


@dataclasses.dataclass(frozen=True)
class RaggedDecodeAttentionConfig(BaseOperationConfig):
    """Config of ``ragged_decode_attention``: ``platform``, ``backend``, ``fwd_params``, ``bwd_params``."""


@dataclasses.dataclass(frozen=True)
class BlockSparseAttentionConfig(BaseOperationConfig):
    """Config of ``block_sparse_attention``: ``platform``, ``backend``, ``fwd_params``, ``bwd_params``."""


@dataclasses.dataclass(frozen=True)
class NativeSparseAttentionConfig(BaseOperationConfig):
    """Config of ``native_sparse_attention``: ``platform``, ``backend``, ``fwd_params``, ``bwd_params``."""


@dataclasses.dataclass(frozen=True)
class MultiHeadLatentAttentionConfig(BaseOperationConfig):
    """Config of ``multi_head_latent_attention``: ``platform``, ``backend``, ``fwd_params``, ``bwd_params``."""


@dataclasses.dataclass(frozen=True)
class GLAConfig(BaseOperationConfig):
    """Config of ``gla``: ``platform``, ``backend``, ``fwd_params``, ``bwd_params``."""


@dataclasses.dataclass(frozen=True)
class LightningAttnConfig(BaseOperationConfig):
    """Config of ``lightning_attn``: ``platform``, ``backend``, ``fwd_params``, ``bwd_params``."""


@dataclasses.dataclass(frozen=True)
class RecurrentConfig(BaseOperationConfig):
    """Config of ``recurrent``: ``platform``, ``backend``, ``fwd_params``, ``bwd_params``."""


@dataclasses.dataclass(frozen=True)
class GatedDeltaRuleConfig(BaseOperationConfig):
    """Config of ``gated_delta_rule``: ``platform``, ``backend``, ``fwd_params``, ``bwd_params``."""


@dataclasses.dataclass(frozen=True)
class MeanPoolingConfig(BaseOperationConfig):
    """Config of ``mean_pooling``: ``platform``, ``backend``, ``fwd_params``, ``bwd_params``."""


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig(BaseOperationConfig):
    """Config of ``grouped_matmul``: ``platform``, ``backend``, ``fwd_params``, ``bwd_params``."""


__all__ = [
    "AttentionConfig",
    "BaseOperationConfig",
    "BlockSparseAttentionConfig",
    "FlashAttentionConfig",
    "GLAConfig",
    "GatedDeltaRuleConfig",
    "GroupedMatmulConfig",
    "LightningAttnConfig",
    "MeanPoolingConfig",
    "MultiHeadLatentAttentionConfig",
    "NativeSparseAttentionConfig",
    "PageAttentionConfig",
    "RaggedDecodeAttentionConfig",
    "RaggedPageAttentionConfig",
    "RecurrentConfig",
    "RingAttentionConfig",
    "ScaledDotProductAttentionConfig",
]
