"""The ``gla`` conformance suite (it lives in ``ejkernel.testing.conformance`` so plugins can reuse it)."""

from ejkernel.testing.conformance.test_gla import *  # noqa: F403
from ejkernel.testing.conformance.test_gla import pytest_generate_tests  # noqa: F401
