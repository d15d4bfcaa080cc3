"""Mosaic TPU ragged paged attention: mixed prefill and decode in one batch (see ``interface``)."""

from ejkernel_pallas.tpu.ragged_page_attention.interface import (
    candidate_cfgs,
    heuristic_cfg,
    ragged_page_attention,
    ragged_page_attention_interpret,
    supports,
)

__all__ = [
    "candidate_cfgs",
    "heuristic_cfg",
    "ragged_page_attention",
    "ragged_page_attention_interpret",
    "supports",
]
