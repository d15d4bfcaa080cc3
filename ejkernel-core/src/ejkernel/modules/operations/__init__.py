"""One module per op: its ``Kernel`` subclass and public function."""

from ejkernel.modules.operations.configs import BaseOperationConfig, FlashAttentionConfig
from ejkernel.modules.operations.flash_attention import FlashAttention, flash_attention

__all__ = ["BaseOperationConfig", "FlashAttention", "FlashAttentionConfig", "flash_attention"]
