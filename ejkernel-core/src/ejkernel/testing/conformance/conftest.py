"""Fixtures of the conformance suites when run from the package (``pytest --pyargs ejkernel.testing.conformance``)."""

from ejkernel.testing.conformance._harness import ejkernel_full_precision_matmuls, gpu_tier, tier  # noqa: F401
