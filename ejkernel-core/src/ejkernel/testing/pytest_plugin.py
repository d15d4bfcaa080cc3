"""pytest plugin (entry point ``pytest11``): options that select which implementations the conformance suites test.

``--ejkernel-platform=NAME`` (repeatable) tests only those platforms' implementations;
``--ejkernel-backend=NAME`` tests implementations registered for that backend instead of the
current device's (e.g. ``cpu`` with an interpreter). Conformance tests run float32 matmuls at full precision
(a fixture below). Loading this plugin imports nothing heavy.
"""

from __future__ import annotations

from typing import Any

import pytest


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("ejkernel")
    group.addoption(
        "--ejkernel-platform",
        action="append",
        default=[],
        metavar="NAME",
        help="run the ejkernel conformance suites only against this platform's implementations",
    )
    group.addoption(
        "--ejkernel-backend",
        default=None,
        metavar="NAME",
        help="test implementations registered for this backend (default: JAX's default device)",
    )


@pytest.fixture(autouse=True)
def ejkernel_full_precision_matmuls(request: Any) -> Any:
    """Conformance tests (those taking ``impl``) run float32 matmuls at full precision: on GPUs JAX's default
    is TF32 (10 mantissa bits), which the suites' float32 tolerances do not allow, for an implementation
    and the reference alike. Other tests are left alone."""
    if "impl" not in request.fixturenames:
        yield
        return
    import jax

    with jax.default_matmul_precision("float32"):
        yield
