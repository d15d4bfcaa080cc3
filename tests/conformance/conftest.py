"""Fixtures of the conformance suites (shared with ``ejkernel.testing.conformance``'s own conftest)."""

from ejkernel.testing.conformance._harness import ejkernel_full_precision_matmuls, gpu_tier, tier  # noqa: F401
