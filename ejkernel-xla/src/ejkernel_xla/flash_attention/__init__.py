"""XLA ``flash_attention``."""

from ejkernel_xla.flash_attention.interface import candidate_cfgs, flash_attention, heuristic_cfg

__all__ = ["candidate_cfgs", "flash_attention", "heuristic_cfg"]
