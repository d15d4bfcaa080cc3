"""XLA ``gated_delta_rule``."""

from ejkernel_xla.gated_delta_rule.interface import candidate_cfgs, gated_delta_rule, heuristic_cfg

__all__ = ["candidate_cfgs", "gated_delta_rule", "heuristic_cfg"]
