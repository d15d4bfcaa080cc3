"""The ``ragged_decode_attention`` conformance suite (it lives in ``ejkernel.testing.conformance`` so plugins can reuse it)."""

from ejkernel.testing.conformance.test_ragged_decode_attention import *  # noqa: F403
from ejkernel.testing.conformance.test_ragged_decode_attention import pytest_generate_tests  # noqa: F401
