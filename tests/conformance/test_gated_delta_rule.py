"""The ``gated_delta_rule`` conformance suite (it lives in ``ejkernel.testing.conformance`` so plugins can reuse it)."""

from ejkernel.testing.conformance.test_gated_delta_rule import *  # noqa: F403
from ejkernel.testing.conformance.test_gated_delta_rule import pytest_generate_tests  # noqa: F401
