"""Shared machinery of the conformance suites: which implementations to test, fresh inputs, tolerances."""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.kernels import kernel_registry
from ejkernel.kernels._types import current_backend
from ejkernel.kernels.signatures import OPS

DTYPES = ("float32", "bfloat16", "float16")
# Relative error ||out - ref|| / ||ref|| allowed per input dtype: float32 accumulation everywhere, so
# the error is dominated by rounding the inputs/outputs (bf16: 8 bits of mantissa, fp16: 11).
FWD_RTOL = {"float32": 2e-5, "bfloat16": 1.6e-2, "float16": 2e-3}
GRAD_RTOL = {"float32": 1e-4, "bfloat16": 4e-2, "float16": 6e-3}


def implementations_under_test(config: Any, op: str) -> list[Any]:
    """``pytest.param``s of the implementations of ``op`` selected by ``--ejkernel-platform``/``--ejkernel-backend``."""
    platforms = set(config.getoption("ejkernel_platform", default=[]) or [])
    backend = config.getoption("ejkernel_backend", default=None) or current_backend()
    impls = [
        i for i in kernel_registry.implementations(op, backend=backend) if not platforms or i.platform in platforms
    ]
    if not impls:
        wanted = f" for platform(s) {sorted(platforms)}" if platforms else ""
        reason = (
            f"no implementation of {op}{wanted} installed for backend {backend!r} "
            f"(install one of: {', '.join(OPS[op].provided_by) if op in OPS else 'a plugin that provides it'})"
        )
        return [pytest.param(None, id="none-installed", marks=pytest.mark.skip(reason=reason))]
    return [pytest.param(i, id=i.name) for i in impls]


def fresh_key() -> tuple[jax.Array, int]:
    """A new random key each run; the seed is returned so that a failure can be reproduced."""
    seed = int.from_bytes(os.urandom(4), "little")
    return jax.random.key(seed), seed


def relative_error(got: Any, want: Any) -> float:
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    want = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    denom = np.linalg.norm(want)
    return float(np.linalg.norm(got - want) / (denom if denom > 0 else 1.0))


def assert_close(got: Any, want: Any, rtol: float, what: str, seed: int) -> None:
    assert got.shape == want.shape, f"{what}: shape {got.shape} != reference {want.shape} (seed {seed})"
    err = relative_error(got, want)
    assert err <= rtol, f"{what}: relative error {err:.3g} > {rtol:g} (seed {seed})"


def call_forced(fn: Any, impl: Any, *args: Any, **kwargs: Any) -> Any:
    """The public function ``fn`` with exactly the implementation under test forced (``platform="name:backend"``,
    so that another implementation of the same platform, e.g. cuDNN's ``xla:gpu`` beside ``xla:any``, is not used)."""
    backend = None if impl.backend == "any" else impl.backend
    return fn(*args, platform=impl.name, backend=backend, **kwargs)


def jitted(fn: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` compiled once: array options are traced, the rest is static (compiling
    the whole call is much faster on CPU than dispatching it op by op)."""
    arrays = {k: v for k, v in kwargs.items() if isinstance(v, jax.Array)}
    static = {k: v for k, v in kwargs.items() if k not in arrays}
    compiled = jax.jit(lambda arr, *a: fn(*a, **arr, **static))
    return lambda *a: compiled(arrays, *a)


def skip_if_unsupported(impl: Any, kernel: Any, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """An implementation may decline a call (``supports``); then forcing it must fail with that reason, and the
    test is skipped. ``kernel`` is the op's ``Kernel`` instance, ``fn`` its public function."""
    from ejkernel.ops import ConfigError, Invocation

    arguments = kernel.normalize(kernel.bind(args, kwargs))
    reason = impl.supports(Invocation.create(kernel.op_id, arguments, impl.backend))
    if reason is not None:
        with pytest.raises(ConfigError, match="cannot serve"):
            call_forced(fn, impl, *args, **kwargs)
        pytest.skip(f"{impl.name} declines this call: {reason}")
