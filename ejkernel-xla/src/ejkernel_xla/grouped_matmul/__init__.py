"""XLA ``grouped_matmul``: tiled everywhere (``interface``), ``jax.lax.ragged_dot`` on TPU (``ragged``)."""

from ejkernel_xla.grouped_matmul.interface import candidate_cfgs, grouped_matmul, heuristic_cfg

__all__ = ["candidate_cfgs", "grouped_matmul", "heuristic_cfg"]
