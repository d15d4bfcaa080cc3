"""XLA ``mean_pooling``."""

from ejkernel_xla.mean_pooling.interface import mean_pooling

__all__ = ["mean_pooling"]
