"""The kernel registry: which implementations of which op exist, and which one may serve a call.

Implementations come from plugins (``registry.register(..., impl="module:attr")``, imported on
first use) or from in-process code (``@kernel_registry.register(...)`` as a decorator).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import threading
from collections.abc import Callable, Iterable
from typing import Any

from ejkernel.kernels._types import Backend, Platform, current_backend, normalize_backend
from ejkernel.kernels.params import BwdParams, FwdParams, LaunchParams
from ejkernel.kernels.signatures import OPS, OpSpec, check_call_signature, check_signature

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
    """One registered implementation of an op: an object with a ``name`` unique per op.

    ``platform`` (``"xla"``, ``"triton"``, ...) and ``backend`` (``"gpu"``, ``"any"``, ...) are attributes for
    filtering and for ``platform=``. ``fn``, ``supports``, the heuristic, the candidates and the params
    classes may be lazy ``"module:attr"`` strings, imported on first use.

    Two calling conventions: a function with the op's canonical signature (arrays positional, options
    by keyword; it may leave out keyword options it does not support), or, with ``takes_call=True``, a
    function ``fn(call, *, fwd_params, bwd_params)`` receiving one frozen :class:`~ejkernel.ops.Call` and
    declaring the ``options`` it understands. Either way an option the implementation does not know, at a
    non-default value, makes it decline the call (:meth:`declines`): a new option never reaches an old
    plugin silently.
    """

    algorithm: str
    platform: str
    backend: str
    priority: int
    impl: Loadable
    version: str
    plugin: str
    name: str = ""
    supports_fn: Loadable | None = None
    heuristic_fn: Loadable | None = None
    candidates_fn: Loadable | None = None
    fwd_params_ref: type | str | None = None
    bwd_params_ref: type | str | None = None
    takes_call: bool = False
    options: frozenset[str] | None = None
    order: int = 0
    _fn: Callable[..., Any] | None = dataclasses.field(default=None, repr=False)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if not self.name:
            self.name = f"{self.platform}:{self.backend}"  # the seed's decorator form names none

    @property
    def fn(self) -> Callable[..., Any]:
        """The implementation itself, imported and signature-checked on first access."""
        if self._fn is None:
            with self._lock:
                if self._fn is None:
                    fn = self._resolve(self.impl, "impl")
                    self._check(fn)
                    self._fn = fn
        return self._fn

    def _resolve(self, ref: Any, what: str) -> Any:
        where = f"{self.plugin} ({self.algorithm} {self.name!r})"
        try:
            return _load(ref, where)
        except (Exception, SystemExit) as e:  # a module calling sys.exit() must not end the caller
            raise ImportError(f"{where}: cannot import {what} {ref!r}: {type(e).__name__}: {e}") from e

    def _check(self, fn: Callable[..., Any]) -> None:
        where = f"{self.plugin} ({self.algorithm} {self.name!r})"
        if self.takes_call:
            check_call_signature(fn, where)
        else:
            check_signature(self.algorithm, fn, where)

    def resolve(self) -> None:
        """Import everything lazy now (the function, its helpers, its params classes); an install test calls
        this for every registration, so that a typo in a GPU-only one is caught on a CPU.

        Raises:
            ImportError, TypeError: what cannot be imported, or a signature that does not fit.
        """
        self.fn  # noqa: B018
        for ref, what in (
            (self.supports_fn, "supports"),
            (self.heuristic_fn, "heuristic_cfg"),
            (self.candidates_fn, "candidate_cfgs"),
        ):
            if ref is not None:
                self._resolve(ref, what)
        self.params_type("fwd")
        self.params_type("bwd")

    def params_type(self, stage: str) -> type[LaunchParams]:
        """The launch-parameter class of ``stage`` (``"fwd"`` or ``"bwd"``); ``FwdParams``/``BwdParams`` by default."""
        ref = self.fwd_params_ref if stage == "fwd" else self.bwd_params_ref
        if ref is None:
            return FwdParams if stage == "fwd" else BwdParams
        cls = self._resolve(ref, f"{stage} params class") if isinstance(ref, str) else ref
        if not (isinstance(cls, type) and issubclass(cls, LaunchParams) and dataclasses.is_dataclass(cls)):
            raise TypeError(
                f"{self.plugin} ({self.algorithm} {self.name!r}): {stage} params must be a LaunchParams dataclass, got {cls!r}"
            )
        return cls

    def coerce_params(self, params: Any, stage: str) -> LaunchParams | None:
        """``params`` as this implementation's ``stage`` class: itself, or mapped from the generic
        ``FwdParams``/``BwdParams`` (:meth:`LaunchParams.from_generic`).

        Raises:
            TypeError: params of another implementation's class (the message names both).
            ValueError: generic params with a field this implementation's class has not.
        """
        if params is None:
            return None
        cls = self.params_type(stage)
        if isinstance(params, cls):
            return params
        if type(params) in (FwdParams, BwdParams):
            try:
                return cls.from_generic(params)
            except ValueError as e:
                raise ValueError(f"{self.algorithm}: {self.name!r} cannot take {params!r}: {e}") from None
        raise TypeError(
            f"{self.algorithm}: {self.name!r} takes {cls.__name__} as its {stage} params, got "
            f"{type(params).__name__} (the params of another implementation?)"
        )

    def known_options(self) -> frozenset[str] | None:
        """The keyword options this implementation understands (``None``: every option of the op)."""
        if self.takes_call:
            return self.options or frozenset()
        if self.algorithm not in OPS:
            return None
        params = inspect.signature(self.fn).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return None  # **kwargs: it takes whatever comes
        return frozenset(n for n in OPS[self.algorithm].signature.parameters if n in params)

    def declines(self, arguments: Any) -> str | None:
        """Why this implementation cannot take ``arguments`` (by canonical name) because of an option it does
        not know, set to a non-default value; ``None`` when it knows every option that is set."""
        known = self.known_options()
        if known is None or self.algorithm not in OPS:
            return None
        for p in OPS[self.algorithm].signature.parameters.values():
            if p.kind is not inspect.Parameter.KEYWORD_ONLY or p.name in known or p.name not in arguments:
                continue
            if not _is_default(arguments[p.name], p.default):
                return f"it does not support option {p.name!r} (set to {_short(arguments[p.name])})"
        return None

    def supports(self, invocation: Any) -> str | None:
        """``None`` when this implementation can serve ``invocation``, else the reason it cannot."""
        reason = self.declines(invocation.arguments)
        if reason is not None or self.supports_fn is None:
            return reason
        return self._resolve(self.supports_fn, "supports")(invocation)

    def heuristic_cfg(self, invocation: Any, stage: str) -> Any:
        """The implementation's default launch parameters for ``stage`` ("fwd" or "bwd"), or None."""
        if self.heuristic_fn is None:
            return None
        return self._resolve(self.heuristic_fn, "heuristic_cfg")(invocation, stage)

    def candidate_cfgs(self, invocation: Any, stage: str) -> list[Any]:
        """Launch parameters worth timing for ``stage``; at least the heuristic one."""
        if self.candidates_fn is None:
            return [self.heuristic_cfg(invocation, stage)]
        return list(self._resolve(self.candidates_fn, "candidate_cfgs")(invocation, stage))

    def runs_on(self, backend: str) -> bool:
        return self.backend in (Backend.ANY.value, normalize_backend(backend))

    def matches(self, platform: str | None) -> bool:
        """Whether ``platform=`` may select this implementation: ``None``/``"auto"``, its name, its platform, or
        ``"platform:backend"`` (where a name matches, the registry takes only that implementation)."""
        if platform in (None, "auto"):
            return True
        return platform in (self.platform, self.name, f"{self.platform}:{self.backend}")


def _is_default(value: Any, default: Any) -> bool:
    if default is None or isinstance(default, bool):
        return value is default or (default is not None and value == default)
    try:
        return bool(value == default)
    except Exception:  # an array compared with a number
        return False


def _short(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return f"an array of shape {tuple(shape)}" if shape is not None else repr(value)


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
    >>> reg.register("my_op", "triton", "gpu", priority=9, name="my_triton", impl=lambda x: x + 2).name
    'my_triton'
    >>> [impl.name for impl in reg.implementations("my_op", backend="all")]
    ['my_triton', 'xla:any']
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
        name: str | None = None,
        supports: Loadable | None = None,
        heuristic_cfg: Loadable | None = None,
        candidate_cfgs: Loadable | None = None,
        fwd_params: type | str | None = None,
        bwd_params: type | str | None = None,
        takes_call: bool = False,
        options: Iterable[str] | None = None,
        version: str = "0",
        plugin: str | None = None,
    ) -> Any:
        """Register an implementation of ``algorithm``.

        With ``impl`` (a callable or ``"module:attr"``) it registers at once and returns the
        :class:`Implementation`; without it, it returns a decorator (the seed's form). A callable is
        checked against the op's canonical signature now; a lazy reference when first used.

        Args:
            name: unique among ``algorithm``'s implementations (``"cudnn"``, ``"triton_splitk"``);
                default ``"platform:backend"``.
            supports: ``supports(invocation) -> None | reason``.
            heuristic_cfg, candidate_cfgs: ``(invocation, stage) -> params`` / ``-> [params, ...]``.
            fwd_params, bwd_params: this implementation's :class:`~ejkernel.kernels.params.LaunchParams`
                dataclasses (default ``FwdParams``/``BwdParams``); the chain and the caches restore them.
            takes_call: ``impl(call, *, fwd_params, bwd_params)`` gets one bound :class:`~ejkernel.ops.Call`.
            options: with ``takes_call``, the keyword options it understands (any other, set, declines).

        Raises:
            TypeError: the implementation's signature does not fit the op (names the parameter).
            ValueError: ``name`` is already registered for this op by another plugin, or a bad backend.
        """
        if impl is None:

            def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
                self.register(
                    algorithm,
                    platform,
                    backend,
                    priority,
                    impl=fn,
                    name=name,
                    supports=supports,
                    heuristic_cfg=heuristic_cfg,
                    candidate_cfgs=candidate_cfgs,
                    fwd_params=fwd_params,
                    bwd_params=bwd_params,
                    takes_call=takes_call,
                    options=options,
                    version=version,
                    plugin=plugin,
                )
                return fn

            return decorator
        from ejkernel.plugins import manager

        plugin = plugin or manager.current_plugin() or getattr(impl, "__module__", None) or "<in-process>"
        backend_name = normalize_backend(Backend(backend).value if isinstance(backend, Backend) else str(backend))
        if backend_name not in {b.value for b in Backend}:
            raise ValueError(f"{plugin}: backend must be one of {[b.value for b in Backend]}, got {backend!r}")
        if name is not None and (not isinstance(name, str) or not name.strip()):
            raise ValueError(f"{plugin}: an implementation's name must be a non-empty string, got {name!r}")
        if options is not None and not takes_call:
            raise ValueError(
                f"{plugin}: options= is for takes_call=True implementations (the signature says it otherwise)"
            )
        record = Implementation(
            algorithm=algorithm,
            platform=str(Platform(platform).value if isinstance(platform, Platform) else platform).lower(),
            backend=backend_name,
            priority=int(priority),
            impl=impl,
            version=str(version),
            plugin=plugin,
            name=name or "",
            supports_fn=supports,
            heuristic_fn=heuristic_cfg,
            candidates_fn=candidate_cfgs,
            fwd_params_ref=fwd_params,
            bwd_params_ref=bwd_params,
            takes_call=takes_call,
            options=None if options is None else frozenset(options),
        )
        if callable(impl):
            record._check(impl)
            record._fn = impl
        with self._lock:
            existing = self._impls.setdefault(algorithm, [])
            for other in existing:
                if other.name == record.name:
                    if other.plugin != record.plugin:
                        raise ValueError(
                            f"{plugin}: an implementation of {algorithm!r} named {record.name!r} is already "
                            f"registered by {other.plugin}"
                        )
                    existing.remove(other)  # the same plugin re-registering replaces its own entry
                    break
            self._counter += 1
            record.order = self._counter
            existing.append(record)
        return record

    def register_op(
        self,
        name: str,
        stub: Callable[..., Any],
        validate: Callable[..., None] | None = None,
        *,
        reference: Callable[..., Any] | None = None,
        plugin: str | None = None,
    ) -> OpSpec:
        """Add a new op with its own contract (a plugin's ``ejkernel_register_ops`` hook calls this).

        Args:
            name: the op's name (letters, digits, ``_``); it must not exist yet.
            stub: the canonical signature: arrays positional, options keyword-only with defaults, and
                ``fwd_params=None, bwd_params=None`` last; implementations are checked against it.
            validate: called with the bound arguments at trace time; raises naming the argument.
            reference: the plain function every implementation is checked against.

        Raises:
            ValueError: a bad name, or an op of that name defined by someone else.
        """
        from ejkernel.kernels.signatures import OpSpec, add_op
        from ejkernel.plugins import manager

        if not (isinstance(name, str) and name.isidentifier()):
            raise ValueError(f"an op's name must be an identifier, got {name!r}")
        owner = plugin or manager.current_plugin() or getattr(stub, "__module__", None) or "<in-process>"
        spec = OpSpec(name, stub, validate or (lambda **_: None), reference=reference, owner=owner)
        for p in ("fwd_params", "bwd_params"):
            if p not in spec.signature.parameters:
                raise TypeError(f"{owner}: the stub of op {name!r} must end with {p}=None")
        with self._lock:
            add_op(spec)
        return spec

    def unregister_plugin(self, plugin: str) -> None:
        """Forget every implementation (and op) that ``plugin`` registered."""
        from ejkernel.kernels.signatures import remove_ops

        remove_ops(plugin)
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

        ``platform``: an implementation's name (exactly it), else a platform (all of its implementations) or
        ``"platform:backend"``.
        Order: priority (high first), then platform name, then registration order, so ties are deterministic.
        ``backend="all"`` lists every implementation regardless of device.
        """
        self._ensure_plugins()
        want_platform = None if platform in (None, "auto") else str(getattr(platform, "value", platform)).lower()
        want_backend = current_backend() if backend is None else str(getattr(backend, "value", backend)).lower()
        with self._lock:
            everything = self._impls.get(algorithm, [])
            # An implementation's name selects exactly it; otherwise a platform selects all of its own.
            by_name = want_platform is not None and any(r.name == want_platform for r in everything)
            found = [
                r
                for r in everything
                if (want_platform is None or (r.name == want_platform if by_name else r.matches(want_platform)))
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
