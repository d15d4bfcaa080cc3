"""The ``multi_head_latent_attention`` conformance suite (it lives in ``ejkernel.testing.conformance`` so plugins can reuse it)."""

from ejkernel.testing.conformance.test_multi_head_latent_attention import *  # noqa: F403
from ejkernel.testing.conformance.test_multi_head_latent_attention import pytest_generate_tests  # noqa: F401
