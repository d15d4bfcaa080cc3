"""Mosaic TPU multi-head latent attention for decode, forward and backward (see ``interface``)."""

from ejkernel_pallas.tpu.multi_head_latent_attention.interface import (
    candidate_cfgs,
    heuristic_cfg,
    multi_head_latent_attention,
    multi_head_latent_attention_interpret,
    supports,
)

__all__ = [
    "candidate_cfgs",
    "heuristic_cfg",
    "multi_head_latent_attention",
    "multi_head_latent_attention_interpret",
    "supports",
]
