"""The kernel registry: which implementations of which op exist, and which one may serve a call.

Implementations come from plugins (``registry.register(..., impl="module:attr")``, imported on
first use) or from in-process code (``@kernel_registry.register(...)`` as a decorator).
"""

from __future__ import annotations

import dataclasses
import importlib
import threading
from collections.abc import Callable, Iterable
from typing import Any

from ejkernel.kernels._types import Backend, Platform, current_backend, normalize_backend
from ejkernel.kernels.signatures import OPS, check_signature

Loadable = Callable[..., Any] | str


def _load(ref: Loadable, what: str) -> Callable[..., Any]:
    if callable(ref):
        return ref
    module, _, attr = ref.partition(":")
    if not attr:
        raise ValueError(f"{what}: lazy reference {ref!r} must look like 'package.module:attribute'")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


@dataclasses.dataclass(eq=False)
class Implementation:
    """One registered implementation of an op. ``fn``, ``supports``, ... may be lazy ``"module:attr"`` strings."""

    algorithm: str
    platform: str
    backend: str
    priority: int
    impl: Loadable
    version: str
    plugin: str
    supports_fn: Loadable | None = None
    heuristic_fn: Loadable | None = None
    candidates_fn: Loadable | None = None
    order: int = 0
    _fn: Callable[..., Any] | None = dataclasses.field(default=None, repr=False)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    @property
    def name(self) -> str:
        """``platform:backend``, e.g. ``"triton:gpu"``; unique per op."""
        return f"{self.platform}:{self.backend}"

    @property
    def fn(self) -> Callable[..., Any]:
        """The implementation itself, imported and signature-checked on first access."""
        if self._fn is None:
            with self._lock:
                if self._fn is None:
                    where = f"{self.plugin} ({self.algorithm} on {self.name})"
                    try:
                        fn = _load(self.impl, where)
                    except (Exception, SystemExit) as e:  # a module calling sys.exit() must not end the caller
                        raise ImportError(f"{where}: cannot import {self.impl!r}: {type(e).__name__}: {e}") from e
                    check_signature(self.algorithm, fn, where)
                    self._fn = fn
        return self._fn

    def supports(self, invocation: Any) -> str | None:
        """``None`` when this implementation can serve ``invocation``, else the reason it cannot."""
        if self.supports_fn is None:
            return None
        return _load(self.supports_fn, self.plugin)(invocation)

    def heuristic_cfg(self, invocation: Any, stage: str) -> Any:
        """The implementation's default launch parameters for ``stage`` ("fwd" or "bwd"), or None."""
        return None if self.heuristic_fn is None else _load(self.heuristic_fn, self.plugin)(invocation, stage)

    def candidate_cfgs(self, invocation: Any, stage: str) -> list[Any]:
        """Launch parameters worth timing for ``stage``; at least the heuristic one."""
        if self.candidates_fn is None:
            return [self.heuristic_cfg(invocation, stage)]
        return list(_load(self.candidates_fn, self.plugin)(invocation, stage))

    def runs_on(self, backend: str) -> bool:
        return self.backend in (Backend.ANY.value, normalize_backend(backend))


class KernelRegistry:
    """All implementations of all ops, by op name.

    >>> from ejkernel.kernels import KernelRegistry, Platform, Backend
    >>> reg = KernelRegistry()
    >>> @reg.register("my_op", Platform.XLA, Backend.ANY, priority=5)
    ... def my_op(x):
    ...     return x + 1
    >>> reg.get("my_op")(1)
    2
    >>> [impl.name for impl in reg.implementations("my_op")]
    ['xla:any']
    """

    def __init__(self, *, load_plugins: bool = False) -> None:
        self._impls: dict[str, list[Implementation]] = {}
        self._counter = 0
        self._load_plugins = load_plugins
        self._lock = threading.RLock()

    def _ensure_plugins(self) -> None:
        if self._load_plugins:
            from ejkernel.plugins import manager

            manager.ensure_loaded(self)

    def register(
        self,
        algorithm: str,
        platform: Platform | str,
        backend: Backend | str,
        priority: int = 0,
        *,
        impl: Loadable | None = None,
        supports: Loadable | None = None,
        heuristic_cfg: Loadable | None = None,
        candidate_cfgs: Loadable | None = None,
        version: str = "0",
        plugin: str | None = None,
    ) -> Any:
        """Register an implementation of ``algorithm``.

        With ``impl`` (a callable or ``"module:attr"``) it registers at once and returns the record;
        without it, it returns a decorator (the seed's form). A callable is checked against the
        op's canonical signature now; a lazy reference when first used.

        Raises:
            TypeError: the implementation's signature differs from the op's (names the parameter).
            ValueError: ``platform:backend`` is already registered for this op by another plugin.
        """
        if impl is None:

            def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
                self.register(
                    algorithm,
                    platform,
                    backend,
                    priority,
                    impl=fn,
                    supports=supports,
                    heuristic_cfg=heuristic_cfg,
                    candidate_cfgs=candidate_cfgs,
                    version=version,
                    plugin=plugin,
                )
                return fn

            return decorator
        from ejkernel.plugins import manager

        plugin = plugin or manager.current_plugin() or getattr(impl, "__module__", None) or "<in-process>"
        record = Implementation(
            algorithm=algorithm,
            platform=str(Platform(platform).value if isinstance(platform, Platform) else platform).lower(),
            backend=normalize_backend(Backend(backend).value if isinstance(backend, Backend) else backend),
            priority=int(priority),
            impl=impl,
            version=str(version),
            plugin=plugin,
            supports_fn=supports,
            heuristic_fn=heuristic_cfg,
            candidates_fn=candidate_cfgs,
        )
        if record.backend not in {b.value for b in Backend}:
            raise ValueError(f"{plugin}: backend must be one of {[b.value for b in Backend]}, got {backend!r}")
        if callable(impl):
            check_signature(algorithm, impl, f"{plugin} ({algorithm} on {record.name})")
            record._fn = impl
        with self._lock:
            existing = self._impls.setdefault(algorithm, [])
            for other in existing:
                if other.name == record.name:
                    if other.plugin != record.plugin:
                        raise ValueError(
                            f"{plugin}: {algorithm!r} on {record.name} is already registered by {other.plugin}"
                        )
                    existing.remove(other)  # the same plugin re-registering replaces its own entry
                    break
            self._counter += 1
            record.order = self._counter
            existing.append(record)
        return record

    def unregister_plugin(self, plugin: str) -> None:
        """Forget every implementation that ``plugin`` registered."""
        with self._lock:
            for algorithm in list(self._impls):
                self._impls[algorithm] = [r for r in self._impls[algorithm] if r.plugin != plugin]
                if not self._impls[algorithm]:
                    del self._impls[algorithm]

    def algorithms(self) -> list[str]:
        self._ensure_plugins()
        return sorted(set(self._impls) | set(OPS))

    def implementations(
        self, algorithm: str, *, platform: Platform | str | None = None, backend: Backend | str | None = None
    ) -> list[Implementation]:
        """Implementations of ``algorithm`` that run on ``backend`` (default: JAX's default device), best first.

        Order: priority (high first), then platform name, then registration order, so ties are deterministic.
        ``backend="all"`` lists every implementation regardless of device.
        """
        self._ensure_plugins()
        want_platform = None if platform in (None, "auto") else str(getattr(platform, "value", platform)).lower()
        want_backend = current_backend() if backend is None else str(getattr(backend, "value", backend)).lower()
        with self._lock:
            found = [
                r
                for r in self._impls.get(algorithm, [])
                if (want_platform is None or r.platform == want_platform)
                and (want_backend == "all" or r.runs_on(want_backend))
            ]
        return sorted(found, key=lambda r: (-r.priority, r.platform, r.backend == Backend.ANY.value, r.order))

    def get(
        self, algorithm: str, platform: Platform | str | None = None, backend: Backend | str | None = None
    ) -> Callable[..., Any]:
        """The highest-priority implementation of ``algorithm`` for ``platform``/``backend`` (the function itself).

        Raises:
            LookupError: nothing matches; the message says what is installed and what to install.
        """
        found = self.implementations(algorithm, platform=platform, backend=backend)
        if not found:
            raise LookupError(self.explain_missing(algorithm, platform, backend))
        return found[0].fn

    def explain_missing(self, algorithm: str, platform: Any = None, backend: Any = None) -> str:
        backend_name = current_backend() if backend is None else str(getattr(backend, "value", backend))
        everywhere = self.implementations(algorithm, backend="all")
        spec = OPS.get(algorithm)
        wanted = f"{algorithm!r}" + (
            f" on platform {str(getattr(platform, 'value', platform))!r}" if platform not in (None, "auto") else ""
        )
        if not everywhere:
            hint = (
                f" Install one of: {', '.join(spec.provided_by)} (e.g. `pip install ejkernel-xla`, which runs everywhere)."
                if spec
                else ""
            )
            return f"No implementation of {wanted} is installed.{hint} Run `ejkernel info` to see what is."
        installed = sorted({r.platform for r in everywhere})
        if platform not in (None, "auto"):
            # "name" or "name:backend"; a name no plugin registered is most likely a typo.
            if str(getattr(platform, "value", platform)).lower().partition(":")[0] not in installed:
                return (
                    f"No implementation of {wanted} is installed; the installed platforms of {algorithm!r} are "
                    f"{', '.join(map(repr, installed))} (or 'auto'). Run `ejkernel info` to see what is."
                )
        listed = ", ".join(f"{r.name} (from {r.plugin})" for r in everywhere)
        return f"No implementation of {wanted} runs on backend {backend_name!r}. Installed: {listed}." + (
            " `pip install ejkernel-xla` runs everywhere." if spec else ""
        )


kernel_registry = KernelRegistry(load_plugins=True)
"""The process-wide registry; plugins are loaded into it on first query."""


def iter_all(registry: KernelRegistry) -> Iterable[Implementation]:
    for algorithm in registry.algorithms():
        yield from registry.implementations(algorithm, backend="all")
