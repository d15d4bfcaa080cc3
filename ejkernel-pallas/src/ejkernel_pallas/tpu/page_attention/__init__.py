"""Mosaic TPU paged decode attention (see ``interface``)."""

from ejkernel_pallas.tpu.page_attention.interface import (
    candidate_cfgs,
    heuristic_cfg,
    page_attention,
    page_attention_interpret,
    supports,
)

__all__ = ["candidate_cfgs", "heuristic_cfg", "page_attention", "page_attention_interpret", "supports"]
