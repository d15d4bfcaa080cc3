"""Reference implementations, one module per op: dense, float32 (float64 where enabled), written to be read.

They are the truth every backend is checked against, and depend on no backend. Each function
takes the op's canonical arguments (without the launch parameters ``fwd_params``/``bwd_params``).
"""

from ejkernel.kernels.signatures._attention import attention_allowed  # re-exported: tests build masks with it
from ejkernel.testing.reference.attention import attention
from ejkernel.testing.reference.block_sparse_attention import block_sparse_attention
from ejkernel.testing.reference.flash_attention import flash_attention
from ejkernel.testing.reference.flash_attention_block import flash_attention_block, flash_attention_block_bwd
from ejkernel.testing.reference.gated_delta_rule import gated_delta_rule
from ejkernel.testing.reference.gla import gla
from ejkernel.testing.reference.grouped_matmul import grouped_matmul
from ejkernel.testing.reference.lightning_attn import lightning_attn
from ejkernel.testing.reference.mean_pooling import mean_pooling
from ejkernel.testing.reference.multi_head_latent_attention import multi_head_latent_attention
from ejkernel.testing.reference.native_sparse_attention import native_sparse_attention
from ejkernel.testing.reference.page_attention import page_attention
from ejkernel.testing.reference.ragged_decode_attention import ragged_decode_attention
from ejkernel.testing.reference.ragged_page_attention import ragged_page_attention
from ejkernel.testing.reference.recurrent import recurrent
from ejkernel.testing.reference.ring_attention import ring_attention
from ejkernel.testing.reference.scaled_dot_product_attention import scaled_dot_product_attention

# (one import line per op above; keep them sorted by op)

__all__ = [
    "attention",
    "attention_allowed",
    "block_sparse_attention",
    "flash_attention",
    "flash_attention_block",
    "flash_attention_block_bwd",
    "gated_delta_rule",
    "gla",
    "grouped_matmul",
    "lightning_attn",
    "mean_pooling",
    "multi_head_latent_attention",
    "native_sparse_attention",
    "page_attention",
    "ragged_decode_attention",
    "ragged_page_attention",
    "recurrent",
    "ring_attention",
    "scaled_dot_product_attention",
]
