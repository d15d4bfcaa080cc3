"""``ejkernel_triton.launch`` in Triton's interpreter: an output aliased to an input starts as that input and keeps
what the kernel does not store (two launches fill one array), also when the grid is empty; a bad alias is refused."""

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


@triton.jit
def _fill_row(X_in, value, X, N: tl.constexpr):
    """Row ``program_id`` of ``X [*, N]`` set to ``value``; the other rows are ``X_in``'s (aliased)."""
    i = tl.program_id(0)
    tl.store(X + i * N + tl.arange(0, N), tl.zeros([N], tl.float32) + value)


def test_aliased_output_keeps_what_the_kernel_does_not_store():
    x = jnp.arange(12, dtype=jnp.float32).reshape(3, 4)
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jax.jit
    def run(x):
        (y,) = launch.launch(_fill_row, x, -1.0, out_shape=(out,), grid=(1,), aliases={0: 0}, N=4)
        (z,) = launch.launch(_fill_row, y, -2.0, out_shape=(out,), grid=(0,), aliases={0: 0}, N=4)
        return z

    want = np.arange(12, dtype=np.float32).reshape(3, 4)
    want[0] = -1.0  # the empty launch returns its aliased input
    np.testing.assert_array_equal(np.asarray(run(x)), want)
    np.testing.assert_array_equal(np.asarray(x), np.arange(12, dtype=np.float32).reshape(3, 4))


def test_alias_of_a_scalar_or_another_shape_is_refused():
    x = jnp.zeros((3, 4), jnp.float32)
    with pytest.raises(ValueError, match=r"aliases\[1\] = 0: argument 1 is not an array like output 0"):
        launch.launch(
            _fill_row, x, 1.0, out_shape=(jax.ShapeDtypeStruct((3, 4), jnp.float32),), grid=(1,), aliases={1: 0}, N=4
        )
    with pytest.raises(ValueError, match=r"aliases\[0\] = 0"):
        launch.launch(
            _fill_row, x, 1.0, out_shape=(jax.ShapeDtypeStruct((3, 8), jnp.float32),), grid=(1,), aliases={0: 0}, N=4
        )
