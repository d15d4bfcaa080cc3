"""Entry point of ejkernel-pallas: it registers nothing yet and says so in ``ejkernel info``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ejkernel.plugins import BackendInfo, hookimpl

from ejkernel_pallas import __version__

if TYPE_CHECKING:
    from ejkernel.kernels import KernelRegistry


@hookimpl
def ejkernel_register_kernels(registry: KernelRegistry) -> None:
    """No kernels yet: the Mosaic TPU and Mosaic GPU ones will be registered here, lazily."""


@hookimpl
def ejkernel_backend_info() -> BackendInfo:
    return BackendInfo(
        name="ejkernel-pallas",
        version=__version__,
        platforms=("pallas",),
        available=False,
        reason="no kernels yet (planned: Mosaic TPU and Mosaic GPU)",
    )
