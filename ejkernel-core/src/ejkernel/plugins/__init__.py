"""The plugin system: pluggy hook specs, the ``hookimpl`` marker and entry-point loading.

A minimal plugin::

    from ejkernel.plugins import hookimpl

    @hookimpl
    def ejkernel_register_kernels(registry):
        registry.register("flash_attention", "xla", "any", impl="my_pkg.attn:flash_attention")
"""

import pluggy

from ejkernel.plugins.manager import (
    BackendInfo,
    PluginError,
    PluginRecord,
    PluginWarning,
    plugin_records,
    register_plugin,
    unregister_plugin,
)

hookimpl = pluggy.HookimplMarker("ejkernel")

__all__ = [
    "BackendInfo",
    "PluginError",
    "PluginRecord",
    "PluginWarning",
    "hookimpl",
    "plugin_records",
    "register_plugin",
    "unregister_plugin",
]
