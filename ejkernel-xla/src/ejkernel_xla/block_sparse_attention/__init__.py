"""XLA ``block_sparse_attention``."""

from ejkernel_xla.block_sparse_attention.interface import block_sparse_attention, candidate_cfgs, heuristic_cfg

__all__ = ["block_sparse_attention", "candidate_cfgs", "heuristic_cfg"]
