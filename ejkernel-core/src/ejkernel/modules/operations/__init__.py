"""One module per op: its ``Kernel`` subclass and public function; the ``...Config`` dataclasses in ``configs``."""

from ejkernel.modules.operations.attention import Attention, attention
from ejkernel.modules.operations.block_sparse_attention import (
    BlockSparseAttention,
    block_sparse_attention,
    block_sparse_mask,
)
from ejkernel.modules.operations.configs import *  # noqa: F403
from ejkernel.modules.operations.configs import __all__ as _configs
from ejkernel.modules.operations.flash_attention import FlashAttention, flash_attention
from ejkernel.modules.operations.flash_attention_block import (
    FlashAttentionBlock,
    FlashAttentionBlockBwd,
    FlashAttentionBlockBwdConfig,
    FlashAttentionBlockConfig,
    flash_attention_block,
    flash_attention_block_bwd,
)
from ejkernel.modules.operations.gated_delta_rule import GatedDeltaRule, gated_delta_rule
from ejkernel.modules.operations.gla import GLA, gla
from ejkernel.modules.operations.grouped_matmul import GroupedMatmul, grouped_matmul
from ejkernel.modules.operations.lightning_attn import LightningAttn, lightning_attn
from ejkernel.modules.operations.mask_info import MaskInfo
from ejkernel.modules.operations.mean_pooling import MeanPooling, mean_pooling
from ejkernel.modules.operations.multi_head_latent_attention import (
    MultiHeadLatentAttention,
    flash_mla,
    multi_head_latent_attention,
)
from ejkernel.modules.operations.native_sparse_attention import NativeSparseAttention, native_sparse_attention
from ejkernel.modules.operations.page_attention import PageAttention, page_attention
from ejkernel.modules.operations.ragged_decode_attention import RaggedDecodeAttention, ragged_decode_attention
from ejkernel.modules.operations.ragged_page_attention import RaggedPageAttention, ragged_page_attention
from ejkernel.modules.operations.recurrent import Recurrent, recurrent
from ejkernel.modules.operations.ring_attention import RingAttention, ring_attention, ring_attention_layout
from ejkernel.modules.operations.scaled_dot_product_attention import (
    ScaledDotProductAttention,
    scaled_dot_product_attention,
)

# (one import line per op above this line, sorted by op)

__all__ = [
    *_configs,
    "FlashAttention",
    "flash_attention",
    "MaskInfo",
    "MultiHeadLatentAttention",
    "flash_mla",
    "multi_head_latent_attention",
    "RingAttention",
    "ring_attention",
    "ring_attention_layout",
    "PageAttention",
    "page_attention",
    "RaggedPageAttention",
    "ragged_page_attention",
    "RaggedDecodeAttention",
    "ragged_decode_attention",
    "Attention",
    "attention",
    "ScaledDotProductAttention",
    "scaled_dot_product_attention",
    "BlockSparseAttention",
    "block_sparse_attention",
    "block_sparse_mask",
    "NativeSparseAttention",
    "native_sparse_attention",
    "GatedDeltaRule",
    "gated_delta_rule",
    "MeanPooling",
    "mean_pooling",
    "GroupedMatmul",
    "grouped_matmul",
    "GLA",
    "gla",
    "LightningAttn",
    "lightning_attn",
    "Recurrent",
    "recurrent",
    "FlashAttentionBlock",
    "FlashAttentionBlockBwd",
    "FlashAttentionBlockConfig",
    "FlashAttentionBlockBwdConfig",
    "flash_attention_block",
    "flash_attention_block_bwd",
    # (the op's Kernel class and function above this line)
]
