"""The XLA grouped matmuls: the tiled loop at tiles that divide nothing, and ``ragged_dot`` (the TPU one,
which runs on CPU too), both against the reference with their gradients; and how they are registered.

Inputs are fresh each run; set ``EJKERNEL_TEST_SEED`` to the seed a failure names.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import pytest

from ejkernel.kernels import kernel_registry
from ejkernel.testing.reference import grouped_matmul as reference

from ejkernel_xla.grouped_matmul import grouped_matmul
from ejkernel_xla.grouped_matmul.interface import default_tile
from ejkernel_xla.grouped_matmul.ragged import grouped_matmul as ragged_grouped_matmul
from ejkernel_xla.params import TiledGmmParams

SEED = int(os.environ.get("EJKERNEL_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
SIZES = (9, 0, 14, 1, 0, 6)  # 30 of 37 rows; two empty groups


def _inputs(transpose_rhs: bool, dtype: str = "float32") -> tuple[jax.Array, jax.Array, jax.Array]:
    kl, kr = jax.random.split(jax.random.key(SEED))
    rhs_shape = (6, 12, 10) if transpose_rhs else (6, 10, 12)
    lhs = jax.random.normal(kl, (37, 10)).astype(dtype)
    return lhs, jax.random.normal(kr, rhs_shape).astype(dtype), jnp.array(SIZES, jnp.int32)


def _fwd_bwd(fn, lhs, rhs, sizes, **kw):
    out, vjp = jax.vjp(lambda a, b: fn(a, b, sizes, **kw), lhs, rhs)
    cot = jax.random.normal(jax.random.key(SEED + 1), out.shape).astype(out.dtype)
    return (out, *vjp(cot))


def _rel(got: jax.Array, want: jax.Array) -> float:
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


@pytest.mark.parametrize(("tile", "bwd_tile", "transpose_rhs"), [(1, 7, False), (7, 16, True)])
def test_tiled_at_tiles_that_divide_nothing(tile, bwd_tile, transpose_rhs):
    args = _inputs(transpose_rhs)
    params = {"fwd_params": TiledGmmParams(block_m=tile), "bwd_params": TiledGmmParams(block_m=bwd_tile)}
    got = jax.jit(lambda *a: _fwd_bwd(grouped_matmul, *a, transpose_rhs=transpose_rhs, **params))(*args)
    want = jax.jit(lambda *a: _fwd_bwd(reference, *a, transpose_rhs=transpose_rhs))(*args)
    for name, g, w in zip(("out", "dlhs", "drhs"), got, want):
        assert _rel(g, w) < 1e-5, f"{name} at tile {tile} (seed {SEED})"


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_ragged_dot_implementation(transpose_rhs):
    args = _inputs(transpose_rhs, "bfloat16")
    kw = {"transpose_rhs": transpose_rhs, "preferred_element_type": jnp.float32}
    got = jax.jit(lambda *a: _fwd_bwd(ragged_grouped_matmul, *a, **kw))(*args)
    want = jax.jit(lambda *a: _fwd_bwd(reference, *a, **kw))(*args)
    assert got[0].dtype == jnp.float32 and got[1].dtype == got[2].dtype == jnp.bfloat16
    for name, g, w in zip(("out", "dlhs", "drhs"), got, want):
        assert _rel(g, w) < 2e-2, f"{name} (seed {SEED})"


def test_ragged_dot_serves_tpu_and_the_tiled_loop_everything_else():
    assert [
        i.name for i in kernel_registry.implementations("grouped_matmul", backend="tpu") if i.platform == "xla"
    ] == [
        "ragged_dot",
        "xla",
    ]
    assert [
        i.name for i in kernel_registry.implementations("grouped_matmul", backend="gpu") if i.platform == "xla"
    ] == ["xla"]


def test_default_tile_is_near_the_mean_group():
    assert default_tile(4096, 8) == 128  # capped
    assert default_tile(4096, 64) == 64
    assert default_tile(67, 5) == 8  # at least 8
    assert default_tile(1, 1) == 8  # (the loop cuts a tile to M)
