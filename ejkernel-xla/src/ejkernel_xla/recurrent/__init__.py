"""XLA ``recurrent``."""

from ejkernel_xla.recurrent.interface import candidate_cfgs, heuristic_cfg, recurrent

__all__ = ["candidate_cfgs", "heuristic_cfg", "recurrent"]
