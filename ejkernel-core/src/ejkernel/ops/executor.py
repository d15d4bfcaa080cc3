"""``Executor``: validates a call, resolves its config through the chain and runs it, differentiable in both modes."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import jax

from ejkernel.kernels._types import check_backend, current_backend
from ejkernel.kernels.registry import Implementation, KernelRegistry, kernel_registry
from ejkernel.ops._forward_mode import call_tangent
from ejkernel.ops.config.base import BaseOperationConfig
from ejkernel.ops.config.chain import ConfigError, ConfigSelectorChain, Selection, default_chain
from ejkernel.ops.config.fingerprint import fingerprint_id, stable_hash
from ejkernel.ops.config.persistent import cache_dir
from ejkernel.ops.core import Kernel
from ejkernel.ops.invocation import Invocation, is_array

_records: list[dict[str, Any]] = []


def recorded_invocations() -> list[dict[str, Any]]:
    """Calls recorded while ``EJKERNEL_OPS_RECORD=1`` (also appended to ``<cache dir>/invocations.jsonl``)."""
    return list(_records)


def _record(inv: Invocation, sel: Selection) -> None:
    if os.environ.get("EJKERNEL_OPS_RECORD", "") in ("", "0"):
        return
    rec = {
        "op": inv.op,
        "backend": inv.backend,
        "fingerprint": fingerprint_id(),
        "arguments": inv.to_json(),
        "impl": sel.impl.name,
        "tier": sel.tier,
    }
    _records.append(rec)
    try:
        path = cache_dir() / "invocations.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(rec, sort_keys=True) + "\n")
    except OSError:
        pass  # recording is best effort; the in-memory list above keeps the call


def _scope_name(inv: Invocation, sel: Selection) -> str | None:
    mode = os.environ.get("EJKERNEL_OPS_STAMP", "hash").lower()
    if mode == "none":
        return None
    what = {"impl": sel.impl.name, "params": sel.params.to_dict() if sel.params else {}, "call": inv.to_json()}
    if mode == "json":
        return f"ejkernel.{inv.op}:{json.dumps(what, sort_keys=True, separators=(',', ':'))}"
    return f"ejkernel.{inv.op}:{sel.impl.name}:{stable_hash(what)}"


class Executor:
    """Runs ``Kernel`` calls: validate, restrict to the asked platform/backend, select, run.

    Array arguments are traced; every other argument is static (part of the cache key).
    """

    def __init__(self, chain: ConfigSelectorChain | None = None, registry: KernelRegistry | None = None) -> None:
        self._chain = chain
        self.registry = registry if registry is not None else kernel_registry

    @property
    def chain(self) -> ConfigSelectorChain:
        return self._chain if self._chain is not None else default_chain()

    def __call__(
        self,
        kernel: Kernel[Any],
        *args: Any,
        cfg: BaseOperationConfig | None = None,
        platform: str | None = None,
        backend: str | None = None,
        **kwargs: Any,
    ) -> Any:
        arguments = kernel.bind(args, kwargs)
        kernel.validate(arguments)
        arguments = kernel.normalize(arguments)
        if cfg is not None and not isinstance(cfg, kernel.config_type):
            raise TypeError(f"{kernel.op_id}: cfg must be a {kernel.config_type.__name__}, got {type(cfg).__name__}")
        platform = (
            platform if platform not in (None, "auto") else (cfg.platform if cfg and cfg.platform != "auto" else None)
        )
        backend = None if backend is None else check_backend(backend, f"{kernel.op_id}: backend")
        backend = backend if backend not in (None, "auto") else (cfg.backend if cfg and cfg.backend != "auto" else None)
        run_on = backend or current_backend()
        inv = Invocation.create(kernel.op_id, arguments, run_on)
        # An implementation's name ("cudnn"), a platform ("xla": all of its own), or "platform:backend".
        platform, _, registered_for = (platform or "").partition(":")
        if registered_for:
            where = f"{kernel.op_id}: the backend of platform={platform + ':' + registered_for!r}"
            registered_for = check_backend(registered_for, where, auto=False)
        impls = self.registry.implementations(kernel.op_id, platform=platform or None, backend=run_on)
        if registered_for:
            impls = [i for i in impls if i.backend == registered_for]
        asked = platform + (":" + registered_for if registered_for else "")
        forced = f"platform {asked!r}" if platform else None
        if forced and not impls:  # the registry tells an unknown platform from one for another backend
            raise ConfigError(self.registry.explain_missing(kernel.op_id, asked, run_on))

        dynamic = {k: v for k, v in arguments.items() if is_array(v)}
        static = {k: v for k, v in arguments.items() if k not in dynamic}
        concrete = not any(isinstance(v, jax.core.Tracer) for v in dynamic.values())

        def make_args() -> tuple[Any, ...]:
            inputs = dynamic if concrete else kernel.make_inputs(inv)
            return ({k: inputs[k] for k in dynamic},)

        def call(dyn: Mapping[str, Any], impl: Implementation, fwd_params: Any, bwd_params: Any) -> Any:
            run_cfg = kernel.config_type(
                platform=impl.platform, backend=impl.backend, fwd_params=fwd_params, bwd_params=bwd_params
            )
            return kernel.run({**static, **dyn}, impl=impl, cfg=run_cfg)

        def timing_fn(impl: Implementation, fwd_params: Any, bwd_params: Any) -> Any:
            if bwd_params is None:
                return lambda dyn: call(dyn, impl, fwd_params, None)

            def fwd_bwd(dyn: Mapping[str, Any]) -> Any:
                out, vjp = jax.vjp(lambda d: call(d, impl, fwd_params, bwd_params), dyn)
                # The output too: a backward that reads no residual would let XLA drop the forward.
                return out, vjp(jax.tree.map(jax.numpy.ones_like, out))

            return fwd_bwd

        chain = self.chain
        fwd = chain.select(
            kernel, inv, "fwd", impls, override=cfg, forced=forced, timing_fn=timing_fn, make_args=make_args
        )
        _record(inv, fwd)

        def primal(dyn: Mapping[str, Any], sel: Selection, bwd_params: Any) -> Any:
            scope = _scope_name(inv, sel)
            if scope is None:
                return call(dyn, sel.impl, sel.params, bwd_params)
            with jax.named_scope(scope):
                return call(dyn, sel.impl, sel.params, bwd_params)

        @jax.custom_jvp
        def op(dyn: Mapping[str, Any]) -> Any:
            return primal(dyn, fwd, None)

        def op_jvp(primals: tuple[Any, ...], tangents: tuple[Any, ...]) -> Any:
            # Only reached when the call is differentiated: the implementation is chosen again by
            # forward+backward time ("train"; the same as "fwd" unless autotuning), then its backward's
            # parameters. Its VJP is the transpose of the tangent, so reverse mode runs the kernel's backward.
            (dyn,), (tan,) = primals, tangents
            kw: dict[str, Any] = dict(override=cfg, forced=forced, timing_fn=timing_fn, make_args=make_args)
            train = chain.select(kernel, inv, "train", impls, **kw)
            bwd = chain.select(kernel, inv, "bwd", impls, fwd=train, **kw)
            out, vjp = jax.vjp(lambda d: primal(d, train, bwd.params), dyn)
            return out, call_tangent(lambda p, t: kernel.tangent({**static, **p}, t), dyn, tan, out, vjp)

        op.defjvp(op_jvp, symbolic_zeros=True)
        return op(dynamic)
