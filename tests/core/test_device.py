"""ejkernel.device: device facts (on the CPU, and from the tables by device kind), index math, fold_vmap."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.device import (
    DeviceInfo,
    cdiv,
    device_info,
    first_gpu,
    fold_vmap,
    next_power_of_2,
    round_up,
    shared_memory_per_block,
)

# ------------------------------------------------------------------------------------------------
# Device facts.
# ------------------------------------------------------------------------------------------------


def test_cpu_device_info_has_no_gpu_fields():
    cpu = jax.devices("cpu")[0]
    info = device_info(cpu)
    assert info.platform == "cpu" and info.device_kind == str(cpu.device_kind)
    assert info.compute_capability is info.sm_count is info.shared_memory_per_block is None
    assert not info.has_capability(1, 0)
    assert device_info(cpu) is info  # cached
    assert device_info().platform == jax.devices()[0].platform
    if jax.default_backend() == "cpu":
        assert first_gpu() is None


@pytest.mark.parametrize(
    ("kind", "cc", "sms", "bandwidth", "flops"),
    [
        ("NVIDIA H200", "9.0", 132, 4.8e12, 989.4e12),
        ("NVIDIA H100 80GB HBM3", "9.0", 132, 3.35e12, 989.4e12),
        ("NVIDIA H100 PCIe", "9.0", 114, 2.0e12, 756.0e12),
        ("NVIDIA GH200 480GB", "9.0", 132, 4.0e12, 989.4e12),  # not the H200 row
        ("NVIDIA A100-SXM4-80GB", "8.0", 108, 2.039e12, 312.0e12),
        ("NVIDIA A100-SXM4-40GB", "8.0", 108, 1.555e12, 312.0e12),
        ("NVIDIA L4", "8.9", 58, 0.3e12, 121.0e12),
        ("NVIDIA Some Future GPU", "9.0", None, None, None),
    ],
)
def test_gpu_facts_from_the_tables(kind, cc, sms, bandwidth, flops):
    info = DeviceInfo.from_attributes("gpu", kind, compute_capability=cc)
    major, minor = map(int, cc.split("."))
    assert info.compute_capability == (major, minor)
    assert info.sm_count == sms and info.hbm_bandwidth == bandwidth and info.peak_bf16_flops == flops
    assert info.shared_memory_per_block == shared_memory_per_block((major, minor))
    # what jax reports wins over the table
    assert DeviceInfo.from_attributes("gpu", kind, compute_capability=cc, sm_count=7).sm_count == 7


def test_non_nvidia_devices():
    rocm = DeviceInfo.from_attributes("gpu", "AMD Instinct MI300X", compute_capability="gfx942")
    assert rocm.compute_capability is None and rocm.shared_memory_per_block is None and rocm.sm_count is None
    tpu = DeviceInfo.from_attributes("tpu", "TPU v5 lite")
    assert tpu.compute_capability is None and tpu.hbm_bandwidth == 0.819e12 and tpu.peak_bf16_flops == 197.0e12


def test_shared_memory_per_block():
    assert shared_memory_per_block((9, 0)) == shared_memory_per_block(90) == 232448  # 227 KiB
    assert shared_memory_per_block((8, 0)) == 163 * 1024
    assert shared_memory_per_block((8, 6)) == shared_memory_per_block((12, 0)) == 99 * 1024
    assert shared_memory_per_block((9, 5)) == shared_memory_per_block((9, 0))  # unknown minor: its major's .0
    assert shared_memory_per_block((42, 0)) == 48 * 1024  # unknown: what every GPU allows without opting in


def test_has_capability():
    h100 = DeviceInfo.from_attributes("gpu", "NVIDIA H100 80GB HBM3", compute_capability="9.0")
    assert h100.has_capability(9) and h100.has_capability(8, 9) and not h100.has_capability(9, 1)


# ------------------------------------------------------------------------------------------------
# Index math.
# ------------------------------------------------------------------------------------------------


def test_cdiv_and_round_up_on_ints_and_arrays():
    for b in (1, 2, 3, 7, 128):
        for a in range(-20, 300):
            assert cdiv(a, b) == math.ceil(a / b), (a, b)
            assert round_up(a, b) == math.ceil(a / b) * b
        a = jnp.arange(-20, 300, dtype=jnp.int32)
        np.testing.assert_array_equal(cdiv(a, b), -(-np.asarray(a) // b))
        np.testing.assert_array_equal(jax.jit(round_up, static_argnums=1)(a, b), -(-np.asarray(a) // b) * b)


def test_next_power_of_2():
    for n in range(2000):
        want = 1
        while want < n:
            want *= 2
        assert next_power_of_2(n) == want, n


# ------------------------------------------------------------------------------------------------
# fold_vmap: under vmap, one call over the folded batch; the same numbers as a plain loop.
# ------------------------------------------------------------------------------------------------


def _kernel(calls: list):
    def kernel(x, w, s):
        """x [B, N], w [N] (shared), s [B] -> (x * w + s, row sums [B]): rows independent."""
        calls.append(x.shape)
        y = x * w + s[:, None]
        return y, y.sum(axis=1)

    return kernel


def _loop(fn, in_axes, *args):
    """What ``jax.vmap(fn, in_axes)(*args)`` must give, by indexing: one call per element."""
    size = next(a.shape[ax] for a, ax in zip(args, in_axes) if ax is not None)
    outs = [fn(*(a if ax is None else jnp.take(a, i, axis=ax) for a, ax in zip(args, in_axes))) for i in range(size)]
    return jax.tree.map(lambda *xs: jnp.stack(xs), *outs)


def _assert_same(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("in_axes", "shapes"),
    [
        ((0, None, 0), [(5, 3, 4), (4,), (5, 3)]),  # x and s mapped, w shared
        ((0, None, None), [(5, 3, 4), (4,), (3,)]),  # s unmapped: broadcast before the fold
        ((None, None, 1), [(3, 4), (4,), (3, 5)]),  # only s mapped, on its second axis
        ((2, None, 0), [(3, 4, 5), (4,), (5, 3)]),  # x mapped on its last axis
    ],
)
def test_fold_vmap_folds_into_the_batch(in_axes, shapes):
    rng = np.random.default_rng(0)
    args = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]
    calls: list = []
    folded = fold_vmap(_kernel(calls), in_axes=(0, None, 0), out_axes=(0, 0))
    got = jax.vmap(folded, in_axes=in_axes)(*args)
    _assert_same(got, _loop(_kernel([]), in_axes, *args))
    assert (15, 4) in calls  # one call over 5 x 3 rows
    _assert_same(jax.jit(jax.vmap(folded, in_axes=in_axes))(*args), got)


def test_fold_vmap_nested_and_non_leading_batch_axes():
    # kernel with its batch axis last (x [N, B]) and a negative out axis: nested vmap folds twice
    calls: list = []

    def kernel(x, s):
        calls.append(x.shape)
        return x * 2.0 + s, (x * s).sum(axis=0)

    folded = fold_vmap(kernel, in_axes=(-1, 0), out_axes=(-1, 0))
    x = jnp.arange(2 * 3 * 4 * 5, dtype=jnp.float32).reshape(2, 3, 4, 5)  # [V1, V2, N, B]
    s = jnp.arange(3 * 5, dtype=jnp.float32).reshape(3, 5)  # [V2, B]: shared by the outer level
    got = jax.vmap(jax.vmap(folded), in_axes=(0, None))(x, s)
    want = _loop(lambda xo: _loop(kernel, (0, 0), xo, s), (0,), x)
    _assert_same(got, want)
    assert (4, 2 * 3 * 5) in calls


def test_fold_vmap_falls_back_to_one_call_per_element():
    rng = np.random.default_rng(1)
    x, w, s = (jnp.asarray(rng.standard_normal(sh), jnp.float32) for sh in [(5, 3, 4), (5, 4), (5, 3)])
    calls: list = []
    # w is shared (None) but mapped here: it cannot fold
    got = jax.vmap(fold_vmap(_kernel(calls), in_axes=(0, None, 0), out_axes=(0, 0)))(x, w, s)
    _assert_same(got, _loop(_kernel([]), (0, 0, 0), x, w, s))
    assert (15, 4) not in calls and (3, 4) in calls
    # a result that is not per row (out axis None) cannot fold either
    calls.clear()
    got = jax.vmap(fold_vmap(_kernel(calls), in_axes=(0, None, 0), out_axes=(0, None)), in_axes=(0, None, 0))(
        x, w[0], s
    )
    _assert_same(got, _loop(_kernel([]), (0, None, 0), x, w[0], s))
    assert (15, 4) not in calls
    # in_axes=None: the sequential rule (what ejkernel_triton.launch uses)
    got = jax.vmap(fold_vmap(_kernel([]), in_axes=None, out_axes=None), in_axes=(0, None, 0))(x, w[0], s)
    _assert_same(got, _loop(_kernel([]), (0, None, 0), x, w[0], s))


def test_fold_vmap_pytree_arguments():
    # in_axes as pytree prefixes: a dict with a shared entry and an absent (None) one
    calls: list = []

    def kernel(x, aux):
        calls.append(x.shape)
        assert aux["absent"] is None
        return x + aux["rows"][:, None] * aux["table"][None, :]

    folded = fold_vmap(kernel, in_axes=(0, {"rows": 0, "table": None, "absent": 0}), out_axes=0)
    x = jnp.ones((4, 2, 3))
    aux = {"rows": jnp.arange(8.0).reshape(4, 2), "table": jnp.arange(3.0), "absent": None}
    got = jax.vmap(folded, in_axes=(0, {"rows": 0, "table": None, "absent": None}))(x, aux)
    want = jnp.stack([kernel(x[i], {**aux, "rows": aux["rows"][i]}) for i in range(4)])
    _assert_same(got, want)
    assert (8, 3) in calls
    with pytest.raises(ValueError, match="prefix"):
        jax.vmap(fold_vmap(kernel, in_axes=(0, (0, 0)), out_axes=0), in_axes=(0, {**dict.fromkeys(aux), "rows": 0}))(
            x, aux
        )


def test_fold_vmap_without_vmap_is_the_function():
    calls: list = []
    folded = fold_vmap(_kernel(calls), in_axes=(0, None, 0), out_axes=(0, 0))
    x, w, s = jnp.ones((3, 4)), jnp.arange(4.0), jnp.arange(3.0)
    _assert_same(folded(x, w, s), _kernel([])(x, w, s))
