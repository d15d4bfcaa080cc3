"""Hook specifications every ejkernel plugin may implement.

A plugin is a module (or object) with functions marked ``@ejkernel.plugins.hookimpl`` and is
found through the ``ejkernel`` entry-point group::

    [project.entry-points.ejkernel]
    triton = "ejkernel_triton.plugin"
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from ejkernel.kernels.registry import KernelRegistry
    from ejkernel.plugins.manager import BackendInfo

hookspec = pluggy.HookspecMarker("ejkernel")


@hookspec
def ejkernel_register_ops(registry: KernelRegistry) -> None:
    """Add this plugin's own ops by calling ``registry.register_op(name, stub, validate, reference=...)``.

    Called before :func:`ejkernel_register_kernels` of the same plugin, so that its kernels can implement
    them. An op belongs to the plugin that added it and goes when the plugin is unregistered.
    """


@hookspec
def ejkernel_register_kernels(registry: KernelRegistry) -> None:
    """Register this plugin's implementations by calling ``registry.register(...)`` once per implementation.

    Prefer lazy references (``impl="my_plugin.flash_attention:flash_attention"``) so that loading the
    plugin stays cheap and a missing heavy dependency only matters when the kernel is used.
    """


@hookspec
def ejkernel_backend_info() -> BackendInfo:
    """Describe this plugin for diagnostics: name, version, platforms, and whether it can run here (and if not, why)."""
