"""Mosaic GPU kernels for Hopper (``jax.experimental.pallas.mosaic_gpu``); registered for backend ``gpu``."""
