"""The public API: one function per op, with keyword-only options, ``cfg=`` and ``mesh``/``in_specs``/``out_specs``."""

from ejkernel.modules.operations import FlashAttention, FlashAttentionConfig, flash_attention

__all__ = ["FlashAttention", "FlashAttentionConfig", "flash_attention"]
