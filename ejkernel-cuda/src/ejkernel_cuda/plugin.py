"""Entry point of ejkernel-cuda: it registers nothing yet and says so in ``ejkernel info``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ejkernel.plugins import BackendInfo, hookimpl

from ejkernel_cuda import __version__

if TYPE_CHECKING:
    from ejkernel.kernels import KernelRegistry


@hookimpl
def ejkernel_register_kernels(registry: KernelRegistry) -> None:
    """No kernels yet: the CUDA ones (called through XLA FFI) will be registered here, lazily."""


@hookimpl
def ejkernel_backend_info() -> BackendInfo:
    return BackendInfo(
        name="ejkernel-cuda",
        version=__version__,
        platforms=("cuda",),
        available=False,
        reason="no kernels yet (planned: CUDA through XLA FFI)",
    )
