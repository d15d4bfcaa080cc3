"""ejkernel: fast, correct attention and friends for JAX, served by backend plugins.

``import ejkernel`` stays light: submodules (and the plugins) load on first use.

>>> import ejkernel
>>> ejkernel.__version__
'0.1.0'
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_SUBMODULES = ("kernels", "modules", "ops", "plugins", "testing")


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"ejkernel.{name}")
    raise AttributeError(f"module 'ejkernel' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_SUBMODULES])
