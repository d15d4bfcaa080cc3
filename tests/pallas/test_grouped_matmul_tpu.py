"""ejkernel-pallas Mosaic TPU grouped matmul, checked on CPU.

The conformance suite (``tests/conformance``, with ``EJKERNEL_PALLAS_INTERPRET=1``) compares the
kernels in JAX's TPU interpret mode with the reference. This module adds what the suite does not
reach: several row tiles with group boundaries inside them, several tiles of K and N, different
forward and backward tiles, the visit schedule itself, the interpreter's race detection, and lowering
to Mosaic for a TPU (the step before libtpu compiles it).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import types

import pytest

if importlib.util.find_spec("ejkernel_pallas") is None:
    pytest.skip("ejkernel-pallas is not installed", allow_module_level=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ejkernel.testing.conformance._harness import FWD_RTOL, GRAD_RTOL, assert_close, fresh_key  # noqa: E402
from ejkernel.testing.reference import grouped_matmul as reference  # noqa: E402

from ejkernel_pallas.tpu.grouped_matmul import grouped_matmul, grouped_matmul_interpret  # noqa: E402
from ejkernel_pallas.tpu.grouped_matmul._kernels import ACTIVE, FIRST, LAST, Schedule, num_visits, schedule  # noqa: E402
from ejkernel_pallas.tpu.params import GmmParams  # noqa: E402

FP, BP = GmmParams(block_m=128, block_n=128), GmmParams(block_m=128, block_n=256)


def _inputs(key, m, k, n, sizes, transpose_rhs, dtype):  # noqa: ANN001, ANN202
    kl, kr, kc = jax.random.split(key, 3)
    rhs_shape = (len(sizes), n, k) if transpose_rhs else (len(sizes), k, n)
    lhs = jax.random.normal(kl, (m, k), dtype)
    rhs = jax.random.normal(kr, rhs_shape, dtype)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32), jax.random.normal(kc, (m, n), jnp.float32)


def _check(fn, lhs, rhs, sizes, cot, kwargs, seed):  # noqa: ANN001, ANN202
    dtype = str(lhs.dtype)

    def loss(f):  # noqa: ANN001, ANN202
        return lambda a, b: jnp.sum(f(a, b, sizes, **kwargs).astype(jnp.float32) * cot)

    out = jax.jit(lambda a, b: fn(a, b, sizes, **kwargs))(lhs, rhs)
    want = reference(lhs, rhs, sizes, **kwargs)
    assert out.dtype == want.dtype, f"result dtype {out.dtype} != {want.dtype}"
    assert_close(out, want, FWD_RTOL[dtype], "forward", seed)
    got = jax.jit(jax.grad(loss(fn), argnums=(0, 1)))(lhs, rhs)
    want = jax.grad(loss(reference), argnums=(0, 1))(lhs, rhs)
    for name, g, w, x in zip(("dlhs", "drhs"), got, want, (lhs, rhs)):
        assert g.dtype == x.dtype, f"{name}: dtype {g.dtype} != {x.dtype}"
        assert_close(g, w, GRAD_RTOL[dtype], name, seed)


@pytest.mark.parametrize(
    ("m", "k", "n", "sizes", "options", "dtype"),
    [
        # 3 row tiles, boundaries inside tiles 0 and 1, an empty group, 20 tail rows in no group; K = 1500 is
        # padded to 1536 in 3 tiles of 512 (reduced in the forward, the output columns of d lhs).
        (300, 1500, 260, [50, 0, 130, 100], {}, "float32"),
        # rhs [G, N, K]; the first and last groups empty; the third reaches past M (cut at M).
        (300, 200, 260, [0, 100, 250, 0], {"transpose_rhs": True}, "float32"),
        # bfloat16 inputs, a float32 result (its cotangent is float32 too); one group holds every row.
        (256, 256, 384, [0, 256], {"preferred_element_type": jnp.float32}, "bfloat16"),
    ],
    ids=["tail_and_k_tiles", "transpose_rhs_cut_at_m", "bf16_f32_out"],
)
def test_several_tiles_per_axis(m, k, n, sizes, options, dtype):
    key, seed = fresh_key()
    lhs, rhs, gs, cot = _inputs(key, m, k, n, sizes, options.get("transpose_rhs", False), dtype)

    def fn(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        return grouped_matmul_interpret(*a, **kw, fwd_params=FP, bwd_params=BP)

    _check(fn, lhs, rhs, gs, cot, options, seed)


def test_every_group_empty_gives_zeros():
    key, seed = fresh_key()
    lhs, rhs, gs, cot = _inputs(key, 40, 24, 16, [0, 0, 0], False, "float32")
    out, grads = jax.jit(
        jax.value_and_grad(lambda a, b: jnp.sum(grouped_matmul_interpret(a, b, gs) * cot), argnums=(0, 1))
    )(lhs, rhs)
    assert float(out) == 0.0 and not np.any(grads[0]) and not np.any(grads[1]), f"nonzero result (seed {seed})"


@pytest.mark.parametrize("for_tgmm", [False, True], ids=["gmm", "tgmm"])
def test_schedule_visits_each_group_row_tile_pair_once(for_tgmm):
    """Replay the schedule in NumPy: every row of M is written (gmm) / every group is written (tgmm), each
    (group, row tile) pair with rows is multiplied exactly once, and inactive visits fetch resident blocks."""
    rng = np.random.default_rng(0)
    tm, m = 16, 100
    m_pad = -(-m // tm) * tm
    build = jax.jit(lambda sizes: schedule(sizes, m, m_pad, tm, for_tgmm=for_tgmm).operands())
    g = 5  # one compilation; the random sizes make 0 to 5 of the groups empty
    for _ in range(100):
        sizes = rng.integers(0, 40, g) * (rng.random(g) < 0.7)
        fields = build(jnp.asarray(sizes, jnp.int32))
        s = types.SimpleNamespace(**{f.name: np.asarray(x) for f, x in zip(dataclasses.fields(Schedule), fields)})
        assert s.flags.shape == (num_visits(m_pad, tm, g),)
        ends = np.minimum(np.cumsum(sizes), m)
        starts = np.concatenate([[0], ends[:-1]])
        tiles = range(m_pad // tm)
        want = {(gi, t) for gi in range(g) for t in tiles if max(starts[gi], t * tm) < min(ends[gi], (t + 1) * tm)}
        active = s.flags & ACTIVE != 0
        got = list(zip(s.group[active].tolist(), s.tile[active].tolist()))
        assert sorted(got) == sorted(want) and len(got) == len(want), (sizes, got, want)
        assert np.all(s.fetch[active] == s.tile[active])
        # The output block stays resident over consecutive visits: a row tile's (gmm) / a group's (tgmm).
        assert np.all(np.diff(s.group if for_tgmm else s.tile) >= 0)
        prev = None
        for v in range(len(s.flags)):  # an inactive visit fetches the blocks the last active one did
            if active[v]:
                prev = (s.fetch[v], s.group[v])
            elif prev is not None:
                assert s.fetch[v] == prev[0] and (for_tgmm or s.group[v] == prev[1])
        first = s.flags & FIRST != 0
        if for_tgmm:
            assert sorted(s.group[first].tolist()) == list(range(g))  # each group starts once...
            assert sorted(s.group[s.flags & LAST != 0].tolist()) == list(range(g))  # ...and is written once
        else:
            assert sorted(s.tile[first].tolist()) == list(range(m_pad // tm))  # each row tile written first once


def test_no_races_detected(monkeypatch):
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as interpreter

    monkeypatch.setenv("EJKERNEL_PALLAS_DETECT_RACES", "1")
    key, seed = fresh_key()
    lhs, rhs, gs, cot = _inputs(key, 200, 64, 160, [70, 0, 100], False, "float32")

    def fn(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        return grouped_matmul_interpret(*a, **kw, fwd_params=FP, bwd_params=BP)

    _check(fn, lhs, rhs, gs, cot, {}, seed)
    assert interpreter.races is not None, "race detection did not run"
    assert not interpreter.races.races_found, "the interpreter found a data race"


def test_lowers_to_mosaic_for_a_tpu(monkeypatch):
    """Lower (do not run) the TPU kernels, forward and backward, at a realistic mixture-of-experts shape in
    bfloat16. Lowering is where Pallas checks block shapes against the TPU's tiling and emits Mosaic; only
    libtpu's compiler, absent here, comes after it. A TPU description stands in for the missing chip."""
    from jax._src.pallas.mosaic import tpu_info
    from jax.experimental.pallas import tpu as pltpu

    monkeypatch.setitem(tpu_info.registry, "cpu", lambda: pltpu.get_tpu_info_for_chip(pltpu.ChipVersion.TPU_V5P, 2))
    m, k, n, g = 8192, 2048, 1408, 8
    lhs = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((g,), jnp.int32)
    for transpose_rhs in (False, True):
        rhs = jax.ShapeDtypeStruct((g, n, k) if transpose_rhs else (g, k, n), jnp.bfloat16)

        def fwd(a, b, s):  # noqa: ANN001, ANN202
            return grouped_matmul(a, b, s, transpose_rhs=transpose_rhs)  # noqa: B023

        def grads(a, b, s):  # noqa: ANN001, ANN202
            return jax.grad(lambda x, y: fwd(x, y, s).astype(jnp.float32).sum(), argnums=(0, 1))(a, b)

        for fn, kernels in ((fwd, 1), (grads, 3)):  # forward; forward, d lhs and d rhs
            text = jax.jit(fn).trace(lhs, rhs, sizes).lower(lowering_platforms=("tpu",)).as_text()
            assert text.count("tpu_custom_call") == kernels, f"{fn.__name__}: expected {kernels} Mosaic kernels"


def test_registered_for_the_cpu_under_interpret(monkeypatch):
    from ejkernel.kernels.registry import KernelRegistry

    from ejkernel_pallas import plugin

    monkeypatch.setenv("EJKERNEL_PALLAS_INTERPRET", "1")
    registry = KernelRegistry()
    plugin.ejkernel_register_kernels(registry)
    got = {i.backend for i in registry.implementations("grouped_matmul", backend="all")}
    assert got == {"tpu", "cpu"}, f"registered for {got}"
