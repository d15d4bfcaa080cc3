"""Finding, loading and diagnosing plugins.

Each entry point of the ``ejkernel`` group is loaded in its own ``try``: a plugin that fails to
import or to register (``SystemExit`` included; ``KeyboardInterrupt`` propagates), or whose name an
earlier distribution on ``sys.path`` already took, is skipped with one warning naming it and recorded
as failed (shown by ``ejkernel info``); ``EJKERNEL_STRICT_PLUGINS=1`` turns that into an error.
``EJKERNEL_PLUGINS`` (allow list) and ``EJKERNEL_DISABLE_PLUGINS`` (block list) take comma-separated
entry-point names.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata as md
import os
import threading
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pluggy
from packaging.requirements import Requirement
from packaging.version import Version

from ejkernel.plugins import hookspecs

if TYPE_CHECKING:
    from ejkernel.kernels.registry import KernelRegistry

ENTRY_POINT_GROUP = "ejkernel"


class PluginWarning(UserWarning):
    """A plugin could not be loaded and was skipped."""


class PluginError(RuntimeError):
    """A plugin could not be loaded and ``EJKERNEL_STRICT_PLUGINS=1`` is set."""


@dataclasses.dataclass(frozen=True)
class BackendInfo:
    """What a plugin tells about itself: ``available`` is whether it can run natively on this machine."""

    name: str
    version: str
    platforms: tuple[str, ...]
    available: bool
    reason: str | None = None


@dataclasses.dataclass
class PluginRecord:
    name: str
    distribution: str | None
    version: str | None
    status: str  # "loaded", "failed", "disabled"
    error: str | None = None
    info: BackendInfo | None = None


_lock = threading.RLock()
_pm: pluggy.PluginManager | None = None
_records: dict[str, PluginRecord] = {}
_shadowed: list[PluginRecord] = []  # entry points whose name an earlier one (or an in-process plugin) holds
_loaded_into: set[int] = set()
_current = threading.local()


def plugin_manager() -> pluggy.PluginManager:
    global _pm
    with _lock:
        if _pm is None:
            _pm = pluggy.PluginManager("ejkernel")
            _pm.add_hookspecs(hookspecs)
        return _pm


def current_plugin() -> str | None:
    """The name of the plugin whose ``ejkernel_register_kernels`` is running, if any."""
    return getattr(_current, "name", None)


@contextlib.contextmanager
def _registering(name: str) -> Iterator[None]:
    previous = current_plugin()
    _current.name = name
    try:
        yield
    finally:
        _current.name = previous


def _names(var: str) -> set[str] | None:
    value = os.environ.get(var, "").strip()
    return {n.strip() for n in value.split(",") if n.strip()} if value else None


def _strict() -> bool:
    return os.environ.get("EJKERNEL_STRICT_PLUGINS", "") not in ("", "0", "false", "False")


def _check_core_range(dist: md.Distribution | None) -> None:
    """Refuse a plugin whose distribution asks for a core version other than the running one."""
    if dist is None:
        return
    from ejkernel import __version__ as core_version

    for line in dist.requires or []:
        req = Requirement(line)
        if req.name == "ejkernel-core" and req.marker is None and req.specifier:
            if not req.specifier.contains(Version(core_version), prereleases=True):
                raise RuntimeError(
                    f"{dist.metadata['Name']} {dist.version} needs ejkernel-core{req.specifier}, "
                    f"but ejkernel-core {core_version} is installed"
                )


def _put(record: PluginRecord, shadowed: bool) -> None:
    if shadowed:
        _shadowed.append(record)
    else:
        _records[record.name] = record


def _fail(name: str, dist: md.Distribution | None, error: BaseException | str, *, shadowed: bool = False) -> None:
    message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    _put(
        PluginRecord(name, dist.metadata["Name"] if dist else None, dist.version if dist else None, "failed", message),
        shadowed,
    )
    if _strict():
        cause = error if isinstance(error, BaseException) else None
        raise PluginError(f"ejkernel plugin {name!r} failed to load: {message}") from cause
    warnings.warn(f"ejkernel plugin {name!r} was skipped: {message}", PluginWarning, stacklevel=4)


def register_plugin(
    plugin: Any,
    name: str,
    registry: KernelRegistry | None = None,
    *,
    distribution: str | None = None,
    version: str | None = None,
) -> None:
    """Add a plugin object (module or instance with ``@hookimpl`` functions) and let it register its kernels.

    Tests use this for in-test plugins and undo it with :func:`unregister_plugin`. Errors follow
    the same rules as entry points: warning and "failed", or ``PluginError`` in strict mode.
    """
    from ejkernel.kernels.registry import kernel_registry

    registry = kernel_registry if registry is None else registry
    pm = plugin_manager()
    with _lock:
        if pm.get_plugin(name) is not None:
            raise ValueError(f"an ejkernel plugin named {name!r} is already registered")
        try:
            pm.register(plugin, name=name)
            with _registering(name):
                others = [p for p in pm.get_plugins() if p is not plugin]
                for hook_name in ("ejkernel_register_ops", "ejkernel_register_kernels"):  # its ops first
                    pm.subset_hook_caller(hook_name, remove_plugins=others)(registry=registry)
            info = _backend_info(plugin, name)
        except BaseException as e:
            registry.unregister_plugin(name)
            if pm.is_registered(plugin):
                pm.unregister(plugin)
            if not isinstance(e, (Exception, SystemExit)):
                raise  # KeyboardInterrupt: the user stops the program, not the plugin
            _fail(name, None, e)
            return
        _records[name] = PluginRecord(name, distribution, version, "loaded", None, info)


def unregister_plugin(name: str, registry: KernelRegistry | None = None) -> None:
    """Remove a plugin and every implementation it registered."""
    from ejkernel.kernels.registry import kernel_registry

    registry = kernel_registry if registry is None else registry
    pm = plugin_manager()
    with _lock:
        plugin = pm.get_plugin(name)
        if plugin is not None:
            pm.unregister(plugin)
        registry.unregister_plugin(name)
        _records.pop(name, None)


def _backend_info(plugin: Any, name: str) -> BackendInfo | None:
    fn = getattr(plugin, "ejkernel_backend_info", None)
    if fn is None:
        return None
    info = fn()
    if isinstance(info, dict):
        info = BackendInfo(**info)
    return info


def ensure_loaded(registry: KernelRegistry) -> None:
    """Load every allowed entry point into ``registry`` once."""
    if id(registry) in _loaded_into:
        return
    with _lock:
        if id(registry) in _loaded_into:
            return
        _loaded_into.add(id(registry))  # before loading: a plugin may query the registry while registering
        allow, block = _names("EJKERNEL_PLUGINS"), _names("EJKERNEL_DISABLE_PLUGINS") or set()
        pm, seen = plugin_manager(), set()
        # A stable sort: of two entry points with one name, the first on sys.path keeps it.
        for ep in sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            dist = ep.dist
            shadowed = ep.name in seen or pm.get_plugin(ep.name) is not None
            seen.add(ep.name)
            if (allow is not None and ep.name not in allow) or ep.name in block:
                _put(
                    PluginRecord(
                        ep.name,
                        dist.metadata["Name"] if dist else None,
                        dist.version if dist else None,
                        "disabled",
                        "excluded by EJKERNEL_PLUGINS/EJKERNEL_DISABLE_PLUGINS",
                    ),
                    shadowed,
                )
                continue
            if shadowed:
                this = f"{dist.metadata['Name']} {dist.version}" if dist else "an entry point"
                first = _records.get(ep.name)
                owner = (
                    f"{first.distribution} {first.version} (first on sys.path)"
                    if first is not None and first.distribution is not None
                    else "a plugin registered in-process"
                )
                _fail(
                    ep.name,
                    dist,
                    f"{this} provides a plugin of this name too, but {owner} holds it; uninstall one of them",
                    shadowed=True,
                )
                continue
            try:
                _check_core_range(dist)
                plugin = ep.load()
            except (Exception, SystemExit) as e:  # a plugin calling sys.exit() must not end the user's program
                _fail(ep.name, dist, e)
                continue
            register_plugin(
                plugin,
                ep.name,
                registry,
                distribution=dist.metadata["Name"] if dist else None,
                version=dist.version if dist else None,
            )


def plugin_records() -> list[PluginRecord]:
    """Every plugin seen so far (loaded, failed or disabled), by name; of two with one name, the one loaded first."""
    from ejkernel.kernels.registry import kernel_registry

    ensure_loaded(kernel_registry)
    return sorted([*_records.values(), *_shadowed], key=lambda r: r.name)


def is_loaded(name: str) -> bool:
    """Whether a plugin of this name is loaded now (an entry point, or an in-process one through :func:`register_plugin`)."""
    record = _records.get(name)
    return record is not None and record.status == "loaded"


def distribution_of(name: str) -> str:
    """The distribution that provides plugin ``name`` (its name when it has none, as an in-process plugin)."""
    record = _records.get(name)
    return record.distribution if record is not None and record.distribution else name


def reset() -> None:
    """Forget all plugins (for tests): the next registry query loads the entry points again."""
    from ejkernel.kernels.registry import kernel_registry

    global _pm
    with _lock:
        for name in list(_records):
            kernel_registry.unregister_plugin(name)
        _records.clear()
        _shadowed.clear()
        _loaded_into.clear()
        _pm = None
