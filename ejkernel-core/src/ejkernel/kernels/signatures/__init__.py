"""The catalogue of ops (``OPS``) and the canonical signature every implementation of an op is checked against.

A core op is defined once, in ``ejkernel.modules.operations.<op>``: its contract (the module docstring), its
``validate`` (checks a call's arguments at trace time and raises a ``ValueError``/``TypeError`` naming the
argument, what was expected and what came), its ``Kernel`` and its public function. The canonical signature
is derived from the public function (:func:`canonical_signature`). The catalogue names those by
``"module:attr"`` and imports them on first use, so ``import ejkernel`` stays light and the registry (which
reads ``OPS``) never imports the public API. A plugin's op (``registry.register_op``) brings its own stub.
The modules here whose names start with ``_`` hold the checks and semantics several contracts share.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

DISPATCH_ONLY = frozenset({"platform", "backend", "cfg", "bwd_cfg", "mesh", "in_specs", "out_specs"})
"""Parameters of the public functions that choose how a call runs, not what it computes."""


def canonical_signature(fn: Callable[..., Any]) -> inspect.Signature:
    """The canonical signature of the op whose public function is ``fn``: its parameters (annotations and
    return annotation kept) less the dispatch-only ones (:data:`DISPATCH_ONLY`), then keyword-only
    ``fwd_params=None, bwd_params=None``.

    >>> def op(x, *, alpha: float = 1.0, platform=None, cfg=None): ...
    >>> str(canonical_signature(op))
    "(x, *, alpha: 'float' = 1.0, fwd_params: 'FwdParams | None' = None, bwd_params: 'BwdParams | None' = None)"

    Raises:
        TypeError: ``fn`` takes ``*args`` or ``**kwargs`` (a canonical signature names every parameter).
    """
    sig = inspect.signature(fn)
    kept = [p for p in sig.parameters.values() if p.name not in DISPATCH_ONLY]
    if any(p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD) for p in kept):
        raise TypeError(f"{fn.__qualname__}: a public op function must name every parameter (no *args/**kwargs)")
    tuning = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=f"{cls} | None")
        for name, cls in (("fwd_params", "FwdParams"), ("bwd_params", "BwdParams"))
    ]
    return sig.replace(parameters=[*kept, *tuning])


def _load(ref: Callable[..., Any] | str) -> Callable[..., Any]:
    if callable(ref):
        return ref
    module, _, attr = ref.partition(":")
    fn: Callable[..., Any] = getattr(importlib.import_module(module), attr)
    return fn


class OpSpec:
    """One op's contract: its public function or stub, its validator, ``reference`` (the plain function every
    implementation is checked against) and ``owner`` (``"ejkernel-core"``, or the plugin that registered the
    op through ``registry.register_op``).

    ``stub`` and ``validate`` may be ``"module:attr"`` strings, imported on first use. A core op's ``stub`` is
    its public function and its ``signature`` is derived from it (:func:`canonical_signature`); a plugin's op
    passes its canonical stub (``fwd_params=None, bwd_params=None`` last), taken as it is.
    """

    def __init__(
        self,
        name: str,
        stub: Callable[..., Any] | str,
        validate: Callable[..., None] | str,
        *,
        reference: Callable[..., Any] | None = None,
        owner: str = "ejkernel-core",
    ):
        self.name = name
        self.reference = reference
        self.owner = owner
        self._stub = stub
        self._validate = validate
        self._signature: inspect.Signature | None = None

    @property
    def stub(self) -> Callable[..., Any]:
        """The public function of a core op, the stub of a plugin's op."""
        return _load(self._stub)

    @property
    def validate(self) -> Callable[..., None]:
        return _load(self._validate)

    @property
    def signature(self) -> inspect.Signature:
        """The canonical signature: arrays positional, options keyword-only, ``fwd_params``/``bwd_params`` last."""
        if self._signature is None:
            stub = self.stub
            self._signature = canonical_signature(stub) if self.owner == "ejkernel-core" else inspect.signature(stub)
        return self._signature

    @property
    def provided_by(self) -> tuple[str, ...]:
        """The distributions that implement this op, for "install one of" messages: a core op's ejkernel-xla
        (which implements every core op; a test holds it to that) or a plugin op's owner, then every loaded
        plugin that registered an implementation of it."""
        from ejkernel.kernels.registry import kernel_registry
        from ejkernel.plugins import manager

        first = "ejkernel-xla" if self.owner == "ejkernel-core" else manager.distribution_of(self.owner)
        loaded = [
            manager.distribution_of(impl.plugin)
            for impl in kernel_registry.implementations(self.name, backend="all")
            if manager.is_loaded(impl.plugin)
        ]
        return tuple(dict.fromkeys([first, *sorted(loaded)]))


def _core(name: str, module: str | None = None, validate: str = "validate") -> OpSpec:
    where = f"ejkernel.modules.operations.{module or name}"
    return OpSpec(name, f"{where}:{name}", f"{where}:{validate}")


OPS: dict[str, OpSpec] = {
    spec.name: spec
    for spec in (
        _core("flash_attention"),
        _core("multi_head_latent_attention"),
        _core("gated_delta_rule"),
        _core("mean_pooling"),
        _core("grouped_matmul"),
        _core("ring_attention"),
        _core("page_attention"),
        _core("ragged_page_attention"),
        _core("ragged_decode_attention"),
        _core("attention"),
        _core("scaled_dot_product_attention"),
        _core("block_sparse_attention"),
        _core("native_sparse_attention"),
        _core("gla"),
        _core("lightning_attn"),
        _core("recurrent"),
        # The attention-block contract that schedules (ring attention) are written in: see its module.
        _core("flash_attention_block"),
        _core("flash_attention_block_bwd", "flash_attention_block", "validate_bwd"),
        # (one entry per op above this line, in the order of the catalogue)
    )
}


def add_op(spec: OpSpec) -> None:
    """Make ``spec`` an op (a plugin's new op, through ``registry.register_op``).

    Raises:
        ValueError: an op of that name exists and belongs to someone else (the core or another plugin).
    """
    other = OPS.get(spec.name)
    if other is not None and other.owner != spec.owner:
        raise ValueError(f"{spec.owner}: an op named {spec.name!r} already exists (defined by {other.owner})")
    OPS[spec.name] = spec


def remove_ops(owner: str) -> None:
    """Forget the ops that ``owner`` (a plugin) added; the core's own stay."""
    for name in [n for n, spec in OPS.items() if spec.owner == owner and owner != "ejkernel-core"]:
        del OPS[name]


def check_call_signature(fn: Callable[..., Any], where: str) -> None:
    """Refuse ``fn`` unless it can be called as ``fn(call, *, fwd_params, bwd_params)`` (a bound-call implementation).

    Raises:
        TypeError: naming what does not fit.
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{where}: cannot read the signature of {fn!r}: {e}") from None
    try:
        sig.bind(object(), fwd_params=None, bwd_params=None)
    except TypeError as e:
        raise TypeError(
            f"{where}: a takes_call implementation must accept (call, *, fwd_params, bwd_params): {e}"
        ) from None


def check_signature(op: str, fn: Callable[..., Any], where: str) -> None:
    """Refuse ``fn`` unless its parameters match the canonical signature of ``op``, name for name.

    Keyword options with a default may be left out: the implementation does not support them and
    declines the calls that set them.

    Raises:
        TypeError: naming the first parameter that is missing, extra, misplaced or of the wrong kind.
    """
    if op not in OPS:
        return  # third-party ops have no canonical signature in the core
    expected = list(OPS[op].signature.parameters.values())
    try:
        got = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as e:  # builtins without a signature
        raise TypeError(f"{where}: cannot read the signature of {fn!r}: {e}") from None
    got_names = [p.name for p in got]
    for i, p in enumerate(expected):
        if p.name not in got_names:
            if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is not inspect.Parameter.empty:
                continue  # an option it does not support: it declines calls that set it (Implementation.declines)
            raise TypeError(f"{where}: implementation of {op!r} lacks parameter {p.name!r} ({_describe(p)})")
        q = got[got_names.index(p.name)]
        if q.kind != p.kind:
            raise TypeError(
                f"{where}: parameter {p.name!r} of {op!r} must be {_kind(p.kind)}, the implementation has it {_kind(q.kind)}"
            )
        if got_names.index(p.name) != i and p.kind is not inspect.Parameter.KEYWORD_ONLY:
            raise TypeError(
                f"{where}: parameter {p.name!r} of {op!r} must be at position {i}, found at {got_names.index(p.name)}"
            )
        if (p.default is inspect.Parameter.empty) != (q.default is inspect.Parameter.empty) or (
            p.default is not inspect.Parameter.empty and q.default != p.default
        ):
            raise TypeError(
                f"{where}: parameter {p.name!r} of {op!r} must default to {p.default!r}, found {q.default!r}"
            )
    extra = [n for n in got_names if n not in {p.name for p in expected}]
    if extra:
        raise TypeError(f"{where}: implementation of {op!r} has unexpected parameter {extra[0]!r}")


def _kind(kind: inspect._ParameterKind) -> str:
    return {
        inspect.Parameter.POSITIONAL_ONLY: "positional-only",
        inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
        inspect.Parameter.VAR_POSITIONAL: "*args",
        inspect.Parameter.KEYWORD_ONLY: "keyword-only",
        inspect.Parameter.VAR_KEYWORD: "**kwargs",
    }[kind]


def _describe(p: inspect.Parameter) -> str:
    d = _kind(p.kind)
    return d if p.default is inspect.Parameter.empty else f"{d}, default {p.default!r}"
