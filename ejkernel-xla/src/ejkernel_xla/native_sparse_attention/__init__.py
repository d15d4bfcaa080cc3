"""XLA ``native_sparse_attention``."""

from ejkernel_xla.native_sparse_attention.interface import candidate_cfgs, heuristic_cfg, native_sparse_attention

__all__ = ["candidate_cfgs", "heuristic_cfg", "native_sparse_attention"]
