"""Mosaic GPU flash attention for Hopper: a warp-specialised forward, a blockwise-recompute backward (see ``interface``)."""

from ejkernel_pallas.gpu.flash_attention.interface import (
    candidate_cfgs,
    flash_attention,
    flash_attention_interpret,
    heuristic_cfg,
    supports,
)

__all__ = ["candidate_cfgs", "flash_attention", "flash_attention_interpret", "heuristic_cfg", "supports"]
