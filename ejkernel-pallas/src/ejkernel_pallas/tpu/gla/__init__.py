"""Mosaic TPU gated linear attention (chunked), forward and backward (see ``interface``)."""

from ejkernel_pallas.tpu.gla.interface import candidate_cfgs, gla, gla_interpret, heuristic_cfg, supports

__all__ = ["candidate_cfgs", "gla", "gla_interpret", "heuristic_cfg", "supports"]
