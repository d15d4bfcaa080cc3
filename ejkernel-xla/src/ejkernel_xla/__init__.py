"""ejkernel-xla: every op in plain JAX, compiled by XLA; the backend that runs everywhere."""

__version__ = "0.1.0"
