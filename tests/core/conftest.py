from __future__ import annotations

import pytest

from ejkernel.plugins import register_plugin, unregister_plugin

from ._plugins import CostlyPlugin, calls


@pytest.fixture
def costly_plugin():
    """The in-test ``costly`` plugin, registered for one test and removed after it."""
    calls.clear()
    register_plugin(CostlyPlugin(), "costly-test")
    yield
    unregister_plugin("costly-test")
