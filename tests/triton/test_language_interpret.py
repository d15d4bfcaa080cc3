"""``ejkernel_triton.language``'s math in Triton's interpreter: ``tanh`` (the soft cap's) to a few float32 ulps over
the whole range, small arguments included (a cap of 1000 puts most scores below 0.01), saturating at +-1, NaN kept."""

from __future__ import annotations

import importlib.util
import os

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed: the Triton interpreter tests need it", allow_module_level=True)

os.environ["EJKERNEL_TRITON_INTERPRET"] = os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from ejkernel_triton import launch  # noqa: E402
from ejkernel_triton.language import tanh  # noqa: E402


@triton.jit
def _tanh_kernel(X, Y, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, tanh(tl.load(X + offs)))


def test_tanh_is_accurate_to_a_few_ulps_and_keeps_nan():
    rng = np.random.default_rng(0)
    tiny = np.logspace(-12, 0, 1500) * rng.choice([-1.0, 1.0], 1500)
    x = np.concatenate(
        [tiny, np.linspace(-20.0, 20.0, 540), [0.0, -0.0, 0.2499, 0.25, 0.2501, np.inf, -np.inf, np.nan]]
    )
    x = np.pad(x, (0, 2048 - x.size)).astype(np.float32)
    (y,) = launch.launch(
        _tanh_kernel, jnp.asarray(x), out_shape=(jax.ShapeDtypeStruct(x.shape, jnp.float32),), grid=(1,), N=x.size
    )
    y, want = np.asarray(y, np.float64), np.tanh(x.astype(np.float64))
    finite = np.isfinite(x)
    rel = np.abs(y - want)[finite] / np.maximum(np.abs(want[finite]), np.finfo(np.float32).tiny)
    assert rel.max() < 5e-7, f"worst relative error {rel.max():.2e} at x={x[finite][rel.argmax()]!r}"
    assert np.array_equal(y[~finite & ~np.isnan(x)], np.sign(x[~finite & ~np.isnan(x)]))
    assert np.isnan(y[np.isnan(x)]).all()
