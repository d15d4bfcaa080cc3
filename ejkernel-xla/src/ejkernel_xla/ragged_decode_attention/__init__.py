"""XLA ``ragged_decode_attention``."""

from ejkernel_xla.ragged_decode_attention.interface import candidate_cfgs, heuristic_cfg, ragged_decode_attention

__all__ = ["candidate_cfgs", "heuristic_cfg", "ragged_decode_attention"]
