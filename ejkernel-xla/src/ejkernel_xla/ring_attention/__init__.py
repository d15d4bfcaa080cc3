"""XLA ``ring_attention``."""

from ejkernel_xla.ring_attention.interface import candidate_cfgs, heuristic_cfg, ring_attention

__all__ = ["candidate_cfgs", "heuristic_cfg", "ring_attention"]
