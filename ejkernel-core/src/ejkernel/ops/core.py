"""``Kernel``: the operations-layer description of one op (how to validate, call, configure and tune it)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, ClassVar, Generic, TypeVar

import jax
import numpy as np

from ejkernel.kernels.registry import Implementation
from ejkernel.kernels.signatures import OPS
from ejkernel.ops.call import Call
from ejkernel.ops.config.base import BaseOperationConfig
from ejkernel.ops.invocation import Invocation

Cfg = TypeVar("Cfg", bound=BaseOperationConfig)

TUNING_PARAMS = ("fwd_params", "bwd_params")


class Kernel(Generic[Cfg]):
    """One op as the ``Executor`` runs it. Subclass per op; set ``op_id`` and ``config_type``.

    The forward and backward have their own launch parameters: ``run`` passes ``cfg.fwd_params``
    and ``cfg.bwd_params`` to the implementation, and the executor resolves (and tunes) the
    backward's parameters only when the call is differentiated. Reverse mode runs the
    implementation's own VJP; forward mode takes the tangent from ``tangent``.
    """

    op_id: ClassVar[str]
    config_type: ClassVar[type[BaseOperationConfig]] = BaseOperationConfig

    @property
    def spec(self) -> Any:
        return OPS[self.op_id]

    def bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Arguments by canonical name, defaults filled in (tuning parameters excluded).

        Raises:
            TypeError: an argument the op does not have, or a missing one.
        """
        sig = self.spec.signature
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{self.op_id}: {e}") from None
        bound.apply_defaults()
        return {k: v for k, v in bound.arguments.items() if k not in TUNING_PARAMS}

    def validate(self, arguments: Mapping[str, Any]) -> None:
        """Check the call at trace time; raises an error naming the argument (the op's ``validate``)."""
        self.spec.validate(**arguments)

    def normalize(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """Bring equivalent spellings of options to one form, so they share cache entries."""
        return arguments

    def empty_result(self, arguments: Mapping[str, Any]) -> Any:
        """The result of a call with nothing to compute (no queries, no keys, no rows...), or None to run it.

        Asked (with validated, normalized ``arguments``) only when an array argument has a zero-size axis,
        e.g. the idle step of a server; the call then reaches no implementation, so none has to handle
        zero-size shapes. The result must not depend on the inputs' values: its gradients are zeros.
        """
        return None

    def positional_names(self) -> list[str]:
        return [
            p.name
            for p in self.spec.signature.parameters.values()
            if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        ]

    def run(self, arguments: Mapping[str, Any], *, impl: Implementation, cfg: Cfg) -> Any:
        """Call ``impl`` with the arguments and ``cfg``'s launch parameters (as ``impl``'s own params classes).

        A ``takes_call`` implementation gets one :class:`~ejkernel.ops.call.Call`; any other the canonical
        arguments, less the options it left out of its signature (only ever at their defaults: a call that
        sets one is declined before it gets here).
        """
        fwd_params = impl.coerce_params(cfg.fwd_params, "fwd")
        bwd_params = impl.coerce_params(cfg.bwd_params, "bwd")
        if impl.takes_call:
            return impl.fn(Call(self.op_id, arguments), fwd_params=fwd_params, bwd_params=bwd_params)
        known = impl.known_options()
        positional = [arguments[n] for n in self.positional_names()]
        keyword = {
            k: v for k, v in arguments.items() if k not in self.positional_names() and (known is None or k in known)
        }
        return impl.fn(*positional, **keyword, fwd_params=fwd_params, bwd_params=bwd_params)

    def tangent(self, arguments: Mapping[str, Any], tangents: Mapping[str, Any]) -> Any:
        """The output's tangent at ``arguments`` along ``tangents`` (by name; the rest stand still).

        Forward-mode autodiff (``jax.jvp``, ``jax.jacfwd``, ``jax.linearize``) computes tangents with this;
        reverse mode never calls it. The default is ``jax.jvp`` of the op's reference
        (``ejkernel.testing.reference``): float32 and dense, so slower and larger than the kernels.
        """
        from ejkernel.testing import reference

        fn = getattr(reference, self.op_id, None)
        if fn is None:
            raise NotImplementedError(
                f"{self.op_id}: no forward-mode rule (no reference to take the tangent of); "
                f"use reverse mode (jax.grad, jax.vjp, jax.jacrev)"
            )
        names = list(tangents)

        def f(*xs: Any) -> Any:
            return fn(**{**arguments, **dict(zip(names, xs))})

        return jax.jvp(f, tuple(arguments[k] for k in names), tuple(tangents[k] for k in names))[1]

    def heuristic_cfg(self, inv: Invocation, impl: Implementation, stage: str) -> Any:
        """The launch parameters (``FwdParams`` for ``"fwd"``, ``BwdParams`` for ``"bwd"``) to use untuned.

        The config chain asks this (tier 6, and for unset params of an override); the default is
        ``impl``'s own heuristic. An op overrides it to add op-level policy.
        """
        return impl.heuristic_cfg(inv, stage)

    def candidate_cfgs(self, inv: Invocation, impl: Implementation, stage: str) -> list[Any]:
        """Launch parameters of ``impl`` that the autotuner times for ``stage`` (default: ``impl``'s own)."""
        return impl.candidate_cfgs(inv, stage)

    def make_inputs(self, inv: Invocation, seed: int = 0) -> dict[str, Any]:
        """Concrete inputs of ``inv``'s shapes for timing: random normal floats, zero integers, all-True masks.

        Ops whose integer inputs carry structure (sequence offsets, page tables) override this.
        """
        rng = np.random.default_rng(seed)
        out: dict[str, Any] = {}
        for name, x in inv.arguments.items():
            if isinstance(x, jax.ShapeDtypeStruct):
                dtype = np.dtype(x.dtype)
                if np.issubdtype(dtype, np.floating) or dtype.name == "bfloat16":
                    out[name] = jax.numpy.asarray(rng.standard_normal(x.shape, dtype=np.float32), dtype=x.dtype)
                elif dtype == np.bool_:
                    out[name] = jax.numpy.ones(x.shape, bool)
                else:
                    out[name] = jax.numpy.zeros(x.shape, x.dtype)
        return out
