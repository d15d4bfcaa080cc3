"""ejkernel: fast, correct attention and friends for JAX, served by backend plugins.

``import ejkernel`` stays light: submodules (and the plugins) load on first use.

>>> import ejkernel
>>> ejkernel.__version__
'0.1.0'
>>> from ejkernel import kernel_registry, Platform, Backend
>>> Platform.XLA.value, Backend.ANY.value
('xla', 'any')
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_SUBMODULES = ("device", "kernels", "modules", "ops", "plugins", "testing")
# The seed's ``from ejkernel import kernel_registry, Platform, Backend``, loaded on first use.
_FROM_KERNELS = ("kernel_registry", "Platform", "Backend")


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"ejkernel.{name}")
    if name in _FROM_KERNELS:
        return getattr(importlib.import_module("ejkernel.kernels"), name)
    raise AttributeError(f"module 'ejkernel' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_SUBMODULES, *_FROM_KERNELS])
