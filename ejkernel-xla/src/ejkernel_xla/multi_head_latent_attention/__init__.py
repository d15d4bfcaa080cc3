"""XLA ``multi_head_latent_attention`` (alias ``flash_mla``): dense and paged, blockwise."""

from ejkernel_xla.multi_head_latent_attention.interface import (
    candidate_cfgs,
    default_blocks,
    heuristic_cfg,
    multi_head_latent_attention,
)

__all__ = ["candidate_cfgs", "default_blocks", "heuristic_cfg", "multi_head_latent_attention"]
