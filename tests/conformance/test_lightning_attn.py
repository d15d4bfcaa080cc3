"""The ``lightning_attn`` conformance suite (it lives in ``ejkernel.testing.conformance`` so plugins can reuse it)."""

from ejkernel.testing.conformance.test_lightning_attn import *  # noqa: F403
from ejkernel.testing.conformance.test_lightning_attn import pytest_generate_tests  # noqa: F401
