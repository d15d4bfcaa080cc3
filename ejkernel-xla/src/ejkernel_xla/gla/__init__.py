"""XLA ``gla``."""

from ejkernel_xla.gla.interface import candidate_cfgs, gla, heuristic_cfg

__all__ = ["candidate_cfgs", "gla", "heuristic_cfg"]
