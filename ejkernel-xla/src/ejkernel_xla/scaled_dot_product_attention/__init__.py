"""XLA ``scaled_dot_product_attention`` (and, in ``cudnn``, its cuDNN path for NVIDIA GPUs)."""

from ejkernel_xla.scaled_dot_product_attention.interface import (
    candidate_cfgs,
    heuristic_cfg,
    scaled_dot_product_attention,
)

__all__ = ["candidate_cfgs", "heuristic_cfg", "scaled_dot_product_attention"]
