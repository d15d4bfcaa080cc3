"""Mosaic TPU kernels (run in JAX's TPU interpret mode on CPU for tests: ``EJKERNEL_PALLAS_INTERPRET=1``)."""
