"""ejkernel-pallas Mosaic TPU gated linear attention, checked on CPU.

The conformance suite (``tests/conformance``, with ``EJKERNEL_PALLAS_INTERPRET=1``) compares the kernels in
JAX's TPU interpret mode with the reference at the default chunk. This module adds what the suite does
not: several chunks of several sub-blocks with a different chunk for the backward (which then recomputes
the chunk states), packed sequences that span several chunks under strong gates in bfloat16, the
interpreter's race detection, and lowering to Mosaic for a TPU (the step before libtpu compiles it).
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("ejkernel_pallas") is None:
    pytest.skip("ejkernel-pallas is not installed", allow_module_level=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ejkernel.testing.conformance._harness import FWD_RTOL, GRAD_RTOL, assert_close, fresh_key  # noqa: E402
from ejkernel.testing.conformance._linear_attention import log_gate, normal  # noqa: E402
from ejkernel.testing.reference import gla as reference  # noqa: E402

from ejkernel_pallas.tpu.gla import gla, gla_interpret  # noqa: E402
from ejkernel_pallas.tpu.gla.interface import chunk_size  # noqa: E402
from ejkernel_pallas.tpu.params import GlaChunkParams  # noqa: E402

NAMES = ("q", "k", "v", "g", "initial_state")


def _inputs(seed, b, t, h, dk, dv, n, gate_scale, dtype):  # noqa: ANN001, ANN202
    rng = np.random.default_rng(seed)
    return (
        normal(rng, (b, t, h, dk), dtype),
        normal(rng, (b, t, h, dk), dtype),
        normal(rng, (b, t, h, dv), dtype),
        log_gate(rng, (b, t, h, dk), gate_scale),
        normal(rng, (n, h, dk, dv)),
    )


def _outputs_and_grads(fn, args, kwargs, seed):  # noqa: ANN001, ANN202
    """``(o, final state, grads of all five arrays)`` of a random linear function of both outputs."""
    shapes = jax.eval_shape(lambda *a: fn(*a[:4], initial_state=a[4], output_final_state=True, **kwargs), *args)
    rng = np.random.default_rng(seed + 1)
    r_o, r_s = normal(rng, shapes[0].shape), normal(rng, shapes[1].shape)

    def loss(*a):  # noqa: ANN002, ANN202
        o, s = fn(*a[:4], initial_state=a[4], output_final_state=True, **kwargs)
        return jnp.sum(o.astype(jnp.float32) * r_o) + jnp.sum(s * r_s), (o, s)

    (_, (o, s)), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(5)), has_aux=True))(*args)
    return o, s, grads


@pytest.mark.parametrize(
    ("b", "t", "cu_seqlens", "gate_scale", "dtype", "chunks"),
    [
        # 150 tokens: 3 chunks of 64 (4 sub-blocks each) forward, 10 of 16 backward (states recomputed)
        (2, 150, None, 0.25, "float32", (64, 16)),
        # lengths 5, 65, 0 and 70 (several chunks of 32 each), tokens 140..149 in no sequence; log gates down
        # to -100 per step: exp of prefix-sum differences must never overflow, also in bfloat16
        (1, 150, (0, 5, 70, 70, 140), 30.0, "bfloat16", (32, 128)),
    ],
    ids=["dense_fwd64_bwd16", "varlen_strong_gates_bf16_fwd32_bwd128"],
)
def test_several_chunks_and_sub_blocks(b, t, cu_seqlens, gate_scale, dtype, chunks):
    _, seed = fresh_key()
    n = b if cu_seqlens is None else len(cu_seqlens) - 1
    args = _inputs(seed, b, t, 2, 32, 24, n, gate_scale, dtype)
    kwargs = {} if cu_seqlens is None else {"cu_seqlens": jnp.asarray(cu_seqlens, jnp.int32)}
    params = {"fwd_params": GlaChunkParams(chunk_size=chunks[0]), "bwd_params": GlaChunkParams(chunk_size=chunks[1])}
    o, s, grads = _outputs_and_grads(gla_interpret, args, {**kwargs, **params}, seed)
    o_ref, s_ref, grads_ref = _outputs_and_grads(reference, args, kwargs, seed)
    assert np.all(np.isfinite(np.asarray(o, np.float32))), f"NaN/inf in the output (seed {seed})"
    assert_close(o, o_ref, FWD_RTOL[dtype], "output", seed)
    assert_close(s, s_ref, FWD_RTOL["float32"] * t / 16, "final state", seed)
    for name, got, want in zip(NAMES, grads, grads_ref):
        assert got.dtype == want.dtype, f"d{name}: dtype {got.dtype} != {want.dtype}"
        rtol = GRAD_RTOL[dtype] if want.dtype == jnp.dtype(dtype) else GRAD_RTOL["float32"] * 10
        assert_close(got, want, rtol, f"d{name}", seed)
    if cu_seqlens is not None:
        assert np.all(np.asarray(o[:, cu_seqlens[-1] :]) == 0), "tokens after cu_seqlens[-1] must give zeros"


def test_no_races_detected(monkeypatch):
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as interpreter

    monkeypatch.setenv("EJKERNEL_PALLAS_DETECT_RACES", "1")
    _, seed = fresh_key()
    args = _inputs(seed, 1, 40, 2, 16, 8, 1, 0.25, "float32")
    params = {"fwd_params": GlaChunkParams(chunk_size=16), "bwd_params": GlaChunkParams(chunk_size=16)}
    o, s, grads = _outputs_and_grads(gla_interpret, args, params, seed)
    o_ref, s_ref, grads_ref = _outputs_and_grads(reference, args, {}, seed)
    assert_close(o, o_ref, 1e-5, "output", seed)
    for name, got, want in zip(NAMES, grads, grads_ref):
        assert_close(got, want, 1e-4, f"d{name}", seed)
    assert interpreter.races is not None, "race detection did not run"
    assert not interpreter.races.races_found, "the interpreter found a data race"


def test_chunk_configuration():
    assert chunk_size(None, 4096) == 64
    assert [chunk_size(c, 4096) for c in (1, 16, 48, 64, 128, 512)] == [16, 16, 32, 64, 128, 128]
    assert chunk_size(None, 1) == 16 and chunk_size(128, 40) == 64  # at most T rounded up to a power of two


def test_lowers_to_mosaic_for_a_tpu(monkeypatch):
    """Lower (do not run) the TPU kernels, forward and backward, at a realistic shape in bfloat16.

    Lowering is where Pallas checks block shapes against the TPU's tiling and emits Mosaic; only
    libtpu's compiler, absent here, comes after it. A TPU description stands in for the missing chip.
    """
    from jax._src.pallas.mosaic import tpu_info
    from jax.experimental.pallas import tpu as pltpu

    monkeypatch.setitem(tpu_info.registry, "cpu", lambda: pltpu.get_tpu_info_for_chip(pltpu.ChipVersion.TPU_V5P, 2))
    t, h, d = 1000, 8, 128
    for b, cu_seqlens in ((2, None), (1, jax.ShapeDtypeStruct((5,), jnp.int32))):
        x = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)
        n = b if cu_seqlens is None else cu_seqlens.shape[0] - 1
        state = jax.ShapeDtypeStruct((n, h, d, d), jnp.float32)

        def fwd(q, k, v, g, s, cu):  # noqa: ANN001, ANN202
            return gla(q, k, v, g, initial_state=s, output_final_state=True, cu_seqlens=cu)

        def grads(q, k, v, g, s, cu):  # noqa: ANN001, ANN202
            def loss(*a):  # noqa: ANN002, ANN202
                o, final = fwd(*a, cu)
                return jnp.sum(o.astype(jnp.float32)) + jnp.sum(final)

            return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, g, s)

        for fn, kernels in ((fwd, 1), (grads, 2)):
            lowered = jax.jit(fn).trace(x, x, x, x, state, cu_seqlens).lower(lowering_platforms=("tpu",))
            count = lowered.as_text().count("tpu_custom_call")
            assert count == kernels, f"{fn.__name__} (cu_seqlens={cu_seqlens}): {count} Mosaic kernels, not {kernels}"
