"""pytest plugin (entry point ``pytest11``): options that select which implementations the conformance suites test.

``--ejkernel-platform=NAME`` (repeatable) tests only the implementations of that name or platform;
``--ejkernel-backend=NAME`` tests implementations registered for that backend instead of the
current device's (e.g. ``cpu`` with an interpreter); ``--ejkernel-tier=cpu|gpu`` picks the shapes: ``cpu``
(default) small ones, as CI runs them, ``gpu`` adds realistic ones and every launch configuration an
implementation offers. It adds options and nothing else: no fixture of it touches a
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
        help="run the ejkernel conformance suites only against the implementations of this name or platform",
    )
    group.addoption(
        "--ejkernel-backend",
        default=None,
        metavar="NAME",
        help="test implementations registered for this backend (default: JAX's default device)",
    )
    group.addoption(
        "--ejkernel-tier",
        default="cpu",
        choices=("cpu", "gpu"),
        help="conformance tier: cpu (small shapes, a few launch configurations each) or gpu (also realistic "
        "shapes and every launch configuration)",
    )
