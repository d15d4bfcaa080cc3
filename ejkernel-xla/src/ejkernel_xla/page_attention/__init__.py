"""XLA ``page_attention``."""

from ejkernel_xla.page_attention.interface import candidate_cfgs, heuristic_cfg, page_attention

__all__ = ["candidate_cfgs", "heuristic_cfg", "page_attention"]
