"""Mosaic TPU flash attention, forward and backward (see ``interface``)."""

from ejkernel_pallas.tpu.flash_attention.interface import (
    candidate_cfgs,
    flash_attention,
    flash_attention_interpret,
    heuristic_cfg,
    supports,
)

__all__ = ["candidate_cfgs", "flash_attention", "flash_attention_interpret", "heuristic_cfg", "supports"]
