"""XLA ``lightning_attn``."""

from ejkernel_xla.lightning_attn.interface import candidate_cfgs, heuristic_cfg, lightning_attn

__all__ = ["candidate_cfgs", "heuristic_cfg", "lightning_attn"]
