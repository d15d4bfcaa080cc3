"""Mosaic TPU block-sparse attention, forward and backward (see ``interface``)."""

from ejkernel_pallas.tpu.block_sparse_attention.interface import (
    block_sparse_attention,
    block_sparse_attention_interpret,
    candidate_cfgs,
    heuristic_cfg,
    supports,
)

__all__ = [
    "block_sparse_attention",
    "block_sparse_attention_interpret",
    "candidate_cfgs",
    "heuristic_cfg",
    "supports",
]
