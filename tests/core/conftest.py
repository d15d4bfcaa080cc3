from __future__ import annotations

import pytest

from ejkernel.plugins import register_plugin, unregister_plugin
from ejkernel.testing.reference_plugin import ReferencePlugin

from ._plugins import CostlyPlugin, calls


@pytest.fixture
def costly_plugin():
    """The in-test ``costly`` plugin, registered for one test and removed after it."""
    calls.clear()
    register_plugin(CostlyPlugin(), "costly-test")
    yield
    unregister_plugin("costly-test")


@pytest.fixture(autouse=True)
def reference_plugin():
    """The references as the lowest-priority implementation, so core tests run with the core alone."""
    register_plugin(ReferencePlugin(), "reference")
    yield
    unregister_plugin("reference")
