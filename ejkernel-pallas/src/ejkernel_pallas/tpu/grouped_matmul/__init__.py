"""Mosaic TPU grouped matmul (megablox-style ``gmm`` and ``tgmm``), differentiable (see ``interface``)."""

from ejkernel_pallas.tpu.grouped_matmul.interface import (
    candidate_cfgs,
    grouped_matmul,
    grouped_matmul_interpret,
    heuristic_cfg,
    supports,
)

__all__ = ["candidate_cfgs", "grouped_matmul", "grouped_matmul_interpret", "heuristic_cfg", "supports"]
