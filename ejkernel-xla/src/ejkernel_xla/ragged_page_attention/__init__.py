"""XLA ``ragged_page_attention``."""

from ejkernel_xla.ragged_page_attention.interface import candidate_cfgs, heuristic_cfg, ragged_page_attention

__all__ = ["candidate_cfgs", "heuristic_cfg", "ragged_page_attention"]
