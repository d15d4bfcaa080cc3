"""The references as a plugin: platform ``reference`` on every backend, at the lowest priority.

Tests that exercise the core (dispatch, caching, sharding, the CLI) register it so that they run
with the core alone, whatever plugins are installed:

>>> from ejkernel.plugins import register_plugin, unregister_plugin
>>> register_plugin(ReferencePlugin(), "reference")
>>> import jax.numpy as jnp
>>> from ejkernel.modules import flash_attention
>>> flash_attention(jnp.ones((1, 4, 2, 8)), jnp.ones((1, 4, 1, 8)), jnp.ones((1, 4, 1, 8)), platform="reference").shape
(1, 4, 2, 8)
>>> unregister_plugin("reference")
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ejkernel.kernels.signatures import OPS
from ejkernel.plugins import BackendInfo, hookimpl
from ejkernel.testing import reference


def as_implementation(op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a reference) behind ``op``'s canonical signature; launch parameters are accepted and ignored."""

    @functools.wraps(fn)
    def impl(*args: Any, fwd_params: Any = None, bwd_params: Any = None, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    impl.__signature__ = OPS[op].signature  # type: ignore[attr-defined]
    return impl


class ReferencePlugin:
    """Registers the reference of every catalogued op (platform ``reference``, backend ``any``, priority -1000)."""

    @hookimpl
    def ejkernel_register_kernels(self, registry: Any) -> None:
        for op in OPS:
            if hasattr(reference, op):
                fn = as_implementation(op, getattr(reference, op))
                registry.register(op, "reference", "any", priority=-1000, impl=fn, version="0")

    @hookimpl
    def ejkernel_backend_info(self) -> BackendInfo:
        return BackendInfo(name="ejkernel reference", version="0", platforms=("reference",), available=True)
