"""Mosaic TPU ragged decode attention over a dense cache (see ``interface``)."""

from ejkernel_pallas.tpu.ragged_decode_attention.interface import (
    candidate_cfgs,
    heuristic_cfg,
    ragged_decode_attention,
    ragged_decode_attention_interpret,
    supports,
)

__all__ = [
    "candidate_cfgs",
    "heuristic_cfg",
    "ragged_decode_attention",
    "ragged_decode_attention_interpret",
    "supports",
]
