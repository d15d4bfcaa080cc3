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
