"""pytest plugin (entry point ``pytest11``): options that select which implementations the conformance suites test.

``--ejkernel-platform=NAME`` (repeatable) tests only those platforms' implementations;
``--ejkernel-backend=NAME`` tests implementations registered for that backend instead of the
current device's (e.g. ``cpu`` with an interpreter). It adds options and nothing else: no fixture of it touches a
user's own tests (the conformance suites' fixtures live in their ``conftest.py``). Loading it imports
nothing heavy.
"""

from __future__ import annotations

from typing import Any


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
