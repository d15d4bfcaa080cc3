"""The attention-block conformance suite (it lives in ``ejkernel.testing.conformance`` so plugins can reuse it)."""

from ejkernel.testing.conformance.test_flash_attention_block import *  # noqa: F403
from ejkernel.testing.conformance.test_flash_attention_block import pytest_generate_tests  # noqa: F401
