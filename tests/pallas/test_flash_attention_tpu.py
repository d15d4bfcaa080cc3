"""ejkernel-pallas Mosaic TPU flash attention, checked on CPU.

The conformance suite (``tests/conformance``, with ``EJKERNEL_PALLAS_INTERPRET=1``) compares the
kernels in JAX's TPU interpret mode with the reference. This module adds what the suite does not:
several blocks per axis (the suite's lengths fit one 128-block) so that causal/window block
skipping and the clamped index maps are exercised, different forward and backward blocks, the
interpreter's race detection, and lowering to Mosaic for a TPU (the step before libtpu compiles it).
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("ejkernel_pallas") is None:
    pytest.skip("ejkernel-pallas is not installed", allow_module_level=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from ejkernel.ops.utils.datacarrier import BwdParams, FwdParams  # noqa: E402
from ejkernel.testing.conformance._harness import assert_close, fresh_key  # noqa: E402
from ejkernel.testing.reference import flash_attention as reference  # noqa: E402

from ejkernel_pallas.tpu.flash_attention import flash_attention, flash_attention_interpret  # noqa: E402

FP, BP = FwdParams(q_blocksize=128, kv_blocksize=128), BwdParams(q_blocksize=128, kv_blocksize=256)


def _inputs(key, b, t, s, h, k, d, bias_shape=None):  # noqa: ANN001, ANN202
    kq, kk, kv, kb = jax.random.split(key, 4)
    args = [
        jax.random.normal(kq, (b, t, h, d)),
        jax.random.normal(kk, (b, s, k, d)),
        jax.random.normal(kv, (b, s, k, d)),
    ]
    if bias_shape is not None:
        args.append(jax.random.normal(kb, bias_shape))
    return tuple(args)


def _check(fn, args, kwargs, seed):  # noqa: ANN001, ANN202
    argnums = tuple(range(len(args)))
    cot = jax.random.normal(jax.random.key(seed % 1000), (args[0].shape[:3] + (args[2].shape[-1],)))

    def loss(f):  # noqa: ANN001, ANN202
        return lambda *a: jnp.sum(f(*a, **kwargs) * cot)

    out = jax.jit(lambda *a: fn(*a, **kwargs))(*args)
    assert_close(out, reference(*args, **kwargs), 1e-5, "forward", seed)
    got = jax.jit(jax.grad(loss(fn), argnums=argnums))(*args)
    want = jax.grad(loss(reference), argnums=argnums)(*args)
    for name, g, w in zip(("dq", "dk", "dv", "dbias"), got, want):
        assert_close(g, w, 1e-5, name, seed)


@pytest.mark.parametrize(
    ("t", "s", "options"),
    [
        (300, 260, {"causal": True}),  # T > S: the first query rows see no key
        (260, 300, {"causal": True, "logits_soft_cap": 3.0}),
        (300, 300, {"sliding_window": (100, 20)}),  # blocks skipped on both sides of the band
    ],
    ids=["causal_t_gt_s", "causal_soft_cap", "window"],
)
def test_several_blocks_per_axis(t, s, options):
    key, seed = fresh_key()
    args = _inputs(key, 1, t, s, 2, 1, 16, bias_shape=(1, 1, t, s))

    def fn(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        return flash_attention_interpret(*a, **kw, fwd_params=FP, bwd_params=BP)

    _check(fn, args, options, seed)


def test_no_races_detected(monkeypatch):
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as interpreter

    monkeypatch.setenv("EJKERNEL_PALLAS_DETECT_RACES", "1")
    key, seed = fresh_key()
    args = _inputs(key, 1, 200, 200, 2, 1, 16)

    def fn(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        return flash_attention_interpret(*a, **kw, fwd_params=FP, bwd_params=BP)

    _check(fn, args, {"causal": True}, seed)
    assert interpreter.races is not None, "race detection did not run"
    assert not interpreter.races.races_found, "the interpreter found a data race"


def test_lowers_to_mosaic_for_a_tpu(monkeypatch):
    """Lower (do not run) the TPU kernels, forward and backward, at a realistic shape in bfloat16.

    Lowering is where Pallas checks block shapes against the TPU's tiling and emits Mosaic; only
    libtpu's compiler, absent here, comes after it. A TPU description stands in for the missing chip.
    """
    from jax._src.pallas.mosaic import tpu_info
    from jax.experimental.pallas import tpu as pltpu

    monkeypatch.setitem(tpu_info.registry, "cpu", lambda: pltpu.get_tpu_info_for_chip(pltpu.ChipVersion.TPU_V5P, 2))
    b, t, h, k, d = 2, 1000, 8, 2, 128
    q = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, t, k, d), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((1, h, t, t), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((b, t), jnp.int32)

    def fwd(q, k, v, bias, qs, ks):  # noqa: ANN001, ANN202
        return flash_attention(q, k, v, bias, q_segment_ids=qs, kv_segment_ids=ks, causal=True, logits_soft_cap=3.0)

    def grads(*a):  # noqa: ANN002, ANN202
        return jax.grad(lambda *x: fwd(*x).astype(jnp.float32).sum(), argnums=(0, 1, 2, 3))(*a)

    for fn, kernels in ((fwd, 1), (grads, 3)):
        text = jax.jit(fn).trace(q, kv, kv, bias, seg, seg).lower(lowering_platforms=("tpu",)).as_text()
        assert text.count("tpu_custom_call") == kernels, f"{fn.__name__}: expected {kernels} Mosaic kernels"


def test_interpret_registration_follows_the_environment(monkeypatch):
    from ejkernel.kernels.registry import KernelRegistry

    from ejkernel_pallas import plugin

    for value, backends in (("0", {"tpu", "gpu"}), ("1", {"tpu", "gpu", "cpu"})):  # gpu: the Mosaic GPU kernel
        monkeypatch.setenv("EJKERNEL_PALLAS_INTERPRET", value)
        registry = KernelRegistry()
        plugin.ejkernel_register_kernels(registry)
        got = {i.backend for i in registry.implementations("flash_attention", backend="all")}
        assert got == backends, f"EJKERNEL_PALLAS_INTERPRET={value}: registered for {got}"
    assert "EJKERNEL_PALLAS_INTERPRET=1" in (plugin.ejkernel_backend_info().reason or "")
