"""XLA ``attention``."""

from ejkernel_xla.attention.interface import attention, heuristic_cfg

__all__ = ["attention", "heuristic_cfg"]
