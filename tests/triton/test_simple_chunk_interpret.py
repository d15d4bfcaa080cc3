"""ejkernel-triton's chunked scalar-decay kernels (``ejkernel_triton._simple_chunk``) in Triton's interpreter.

Against the reference (``recurrent`` with a scalar gate, ``lightning_attn``): the output, the final state and the
gradients of every input (the decay's too), bfloat16 and float32, head dims padded and tiled (and K = V = 256),
packing with a one-token and an empty sequence and a boundary mid-chunk, strong decays; which kernels
``lightning_attn`` and ``recurrent`` route to; and that every kernel compiles for sm_90.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed: the Triton interpreter tests need it", allow_module_level=True)

os.environ["EJKERNEL_TRITON_INTERPRET"] = "1"  # before anything imports triton

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ejkernel.testing import reference  # noqa: E402

from ejkernel_triton import _simple_chunk as simple  # noqa: E402
from ejkernel_triton import launch  # noqa: E402
from ejkernel_triton.gla.chunk import ChunkBwdParams, ChunkFwdParams  # noqa: E402

NAMES = ("o", "final", "dq", "dk", "dv", "dg", "dh0")


def _inputs(b, t, h, dk, dv, dtype, *, n=None, seed=0, gate_scale=0.25):
    rng = np.random.default_rng(seed)

    def normal(*shape, dt=dtype):
        return jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dt)

    q, k, v = normal(b, t, h, dk), normal(b, t, h, dk), normal(b, t, h, dv)
    g = jnp.asarray(gate_scale * -np.logaddexp(0.0, -rng.standard_normal((b, t, h))), jnp.float32)
    return (q, k, v, g), normal(n or b, h, dk, dv, dt=jnp.float32)


def _outputs_and_grads(fn, args, h0, **kw):
    rng = np.random.default_rng(1)
    r_o = jnp.asarray(rng.standard_normal(args[2].shape), jnp.float32)
    r_s = jnp.asarray(rng.standard_normal(h0.shape), jnp.float32)

    def loss(*xs):
        o, final = fn(*xs[:-1], initial_state=xs[-1], output_final_state=True, **kw)
        return jnp.sum(o.astype(jnp.float32) * r_o) + jnp.sum(final * r_s), (o, final)

    (_, outs), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(5)), has_aux=True))(*args, h0)
    return (*outs, *grads)


def _rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def _check(got, want, dtype, f32_tol=2e-6):
    # bfloat16 inputs: their own dtype's outputs and gradients at bfloat16 accuracy; the float32 ones (final state,
    # the decay's and the initial state's gradients) at about float32 accuracy
    for name, x, w in zip(NAMES, got, want, strict=True):
        assert x.dtype == w.dtype, name
        assert np.all(np.isfinite(np.asarray(x, np.float32))), name
        tol = 2e-2 if x.dtype == jnp.bfloat16 else (1e-4 if dtype == jnp.bfloat16 else f32_tol)
        assert _rel(x, w) < tol, (name, _rel(x, w))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    ("dk", "dv", "t", "params"),
    [
        # K != V, T not a multiple of the chunk, 16-channel tiles over padded head dims (20 -> 32, 24 -> 32)
        (20, 24, 41, {"chunk_size": 16, "block_k": 16, "block_v": 16}),
        # the default plan (chunks of 64), one partial chunk after a full one
        (32, 16, 70, {}),
    ],
    ids=["tiled_padded", "default_plan"],
)
def test_dense_matches_reference(dk, dv, t, params, dtype):
    args, h0 = _inputs(2, t, 2, dk, dv, dtype, seed=dk + t)
    kw = {"fwd_params": ChunkFwdParams(**params), "bwd_params": ChunkBwdParams(**params)}
    got = _outputs_and_grads(simple.simple_gla, args, h0, **kw)
    want = _outputs_and_grads(reference.recurrent, args, h0)
    _check(got, want, dtype)


@pytest.mark.parametrize(
    ("dtype", "paired"),
    [(jnp.float32, False), (jnp.bfloat16, False), (jnp.bfloat16, True)],
    ids=["f32", "bf16", "bf16_paired_walks"],
)
def test_packed_matches_reference(dtype, paired, monkeypatch):
    """Lengths 1, 16, 0 and 20 in chunks of 16 (every boundary after the first mid-chunk); tokens 37..40 are in no
    sequence: zero output and gradients there. ``paired``: the backward's two state walks in one launch
    (``simple_state_pair``, ``Plan.paired_states``; not yet the default)."""
    if paired:
        plan = simple.default_plan
        monkeypatch.setattr(
            simple,
            "default_plan",
            lambda d, stage="fwd": dataclasses.replace(plan(d, stage), paired_states=stage == "bwd"),
        )
    cu = jnp.asarray([0, 1, 17, 17, 37], jnp.int32)
    args, h0 = _inputs(1, 41, 2, 16, 24, dtype, n=4, seed=5)
    p = {"chunk_size": 16}
    got = []
    kernels = _kernels(
        lambda: got.extend(
            _outputs_and_grads(
                simple.simple_gla,
                args,
                h0,
                cu_seqlens=cu,
                fwd_params=ChunkFwdParams(**p),
                bwd_params=ChunkBwdParams(**p),
            )
        )
    )
    assert ("simple_state_pair" in kernels) == paired and ("simple_state_bwd" in kernels) != paired, kernels
    want = _outputs_and_grads(reference.recurrent, args, h0, cu_seqlens=cu)
    _check(got, want, dtype)
    for x in (got[0], got[2], got[3], got[4], got[5]):
        assert np.all(np.asarray(x)[:, 37:] == 0)
    np.testing.assert_array_equal(np.asarray(got[1][2]), np.asarray(h0[2]))  # the empty sequence keeps its state


def test_head_dim_256():
    """The largest head dims: 4 x 4 tiles of 64 channels in every kernel, a partial chunk."""
    args, h0 = _inputs(1, 20, 1, 256, 256, jnp.float32, seed=9)
    _check(_outputs_and_grads(simple.simple_gla, args, h0), _outputs_and_grads(reference.recurrent, args, h0), None)


def test_strong_decay_and_backward_with_other_chunks():
    """Decays down to exp(-30) a token (cumulative exponents of -600 inside a chunk: nothing overflows), and a
    backward that cuts other chunks than the forward."""
    args, h0 = _inputs(1, 40, 2, 16, 16, jnp.float32, seed=4, gate_scale=30.0)
    kw = {"fwd_params": ChunkFwdParams(chunk_size=32), "bwd_params": ChunkBwdParams(chunk_size=16)}
    got = _outputs_and_grads(simple.simple_gla, args, h0, **kw)
    # dg: rounding of terms near 1 where the reference's are 1e-9 (decayed away): 4e-6 relative
    _check(got, _outputs_and_grads(reference.recurrent, args, h0), None, f32_tol=2e-5)


def _kernels(fn):
    names = []
    real = launch.launch

    def record(kernel, *a, **kw):
        names.append(kernel.__name__)
        return real(kernel, *a, **kw)

    launch.launch = record
    try:
        fn()
    finally:
        launch.launch = real
    return set(names)


def test_lightning_and_recurrent_route_to_the_scalar_kernels():
    """``lightning_attn`` and ``recurrent`` without a key gate run ``simple_gla`` (slope's gradient through the
    broadcast decay, checked against the reference); ``recurrent`` with a key gate the chunked ``gla``."""
    from ejkernel_triton.lightning_attn import chunk as lightning
    from ejkernel_triton.recurrent import chunk as rec

    (q, k, v, g), h0 = _inputs(1, 20, 2, 16, 16, jnp.float32, seed=2)
    slope = jnp.asarray([0.1, 0.7], jnp.float32)

    def lightning_grads(fn):
        def loss(q, k, v, slope, h0):
            o, s = fn(q, k, v, slope, initial_state=h0, output_final_state=True)
            return jnp.sum(o * jnp.cos(o)) + jnp.sum(s**2)

        return jax.grad(loss, argnums=tuple(range(5)))(q, k, v, slope, h0)

    got, want = {}, lightning_grads(reference.lightning_attn)
    names = _kernels(lambda: got.update(enumerate(lightning_grads(lightning.lightning_attn))))
    for i, w in enumerate(want):  # q, k, v, slope, initial_state
        assert _rel(got[i], w) < 1e-5, (i, _rel(got[i], w))
    assert names == {"simple_state_fwd", "simple_output", "simple_state_bwd", "simple_dv", "simple_dqk"}, names
    assert _kernels(lambda: rec.recurrent(q, k, v, g, reverse=True)) == {"simple_state_fwd", "simple_output"}
    assert _kernels(lambda: rec.recurrent(q, k, v)) == {"simple_state_fwd", "simple_output"}
    keyed = _kernels(lambda: rec.recurrent(q, k, v, g, g_k=jnp.zeros_like(q)))  # the chunked gla's kernels
    assert keyed and not any(name.startswith("simple_") for name in keyed), keyed


def test_plans():
    d = simple.Dims(128, 128, 64)
    assert simple.default_plan(d) == simple.Plan(64, 64, 64, 4, 2, 64, 64, 4, 2)
    assert simple.default_plan(simple.Dims(128, 128, 4)).state_v == 32  # few states: smaller state tiles
    plan = simple.make_plan(simple.Dims(20, 8), ChunkBwdParams(block_k=128, chunk_size=16, num_warps=8), "bwd")
    assert (plan.chunk, plan.block_k, plan.block_v, plan.num_warps) == (16, 32, 16, 8)
    assert (plan.state_warps, plan.state_stages) == (4, 2)  # the state passes keep their own launch
    plan = simple.make_plan(d, ChunkFwdParams(state_warps=8, state_stages=3))
    assert (plan.state_warps, plan.state_stages, plan.num_warps) == (8, 3, 4)
    for stage, cls in (("fwd", ChunkFwdParams), ("bwd", ChunkBwdParams)):  # the heuristic's params give its plan
        assert simple.make_plan(d, simple._params(cls, simple.default_plan(d, stage)), stage) == simple.default_plan(
            d, stage
        )


_COMPILE_SCRIPT = textwrap.dedent("""
    import dataclasses
    import jax, jax.numpy as jnp
    from ejkernel_triton import _simple_chunk as simple
    from ejkernel_triton import launch
    from ejkernel_triton._simple_chunk import simple_gla
    assert not launch.INTERPRET

    def grads(b, t, h, dk, dv, dtype):
        z = lambda *shape, dt=dtype: jnp.zeros(shape, dt)

        def loss(q, k, v, g, h0):
            o, s = simple_gla(q, k, v, g, initial_state=h0, output_final_state=True)
            return o.astype(jnp.float32).sum() + s.sum()

        args = (z(b, t, h, dk), z(b, t, h, dk), z(b, t, h, dv), z(b, t, h, dt=jnp.float32), z(b, h, dk, dv, dt=jnp.float32))
        jax.grad(loss, argnums=tuple(range(5)))(*args)

    grads(4, 4096, 16, 128, 128, jnp.bfloat16)  # a training shape, the default plans
    grads(1, 256, 2, 256, 256, jnp.float32)  # float32 dots (three tf32 passes), the largest head dims
    plan = simple.default_plan  # the backward's state walks in one launch (simple_state_pair)
    simple.default_plan = lambda d, stage="fwd": dataclasses.replace(plan(d, stage), paired_states=stage == "bwd")
    grads(2, 64, 16, 128, 128, jnp.bfloat16)  # 32 states: 64 x 64 state tiles (the B2 T16384 plan)
    grads(1, 256, 2, 256, 256, jnp.float32)
    print("compiled")
""")


def test_kernels_compile_for_sm90(tmp_path):
    # The interpreter is not the compiler: compile every kernel of both passes for sm_90 as jax-triton types them
    # (launch.COMPILE_ONLY_ENV), in a fresh process without interpreter mode; shared memory is checked too. The
    # compiled kernels are dumped (launch.IR_DUMP_ENV, what benchmarks/ir_compare.py reads; where it is set already,
    # there).
    env = {k: v for k, v in os.environ.items() if k not in ("EJKERNEL_TRITON_INTERPRET", "TRITON_INTERPRET")}
    env[launch.COMPILE_ONLY_ENV] = "90"
    dump = pathlib.Path(env.setdefault(launch.IR_DUMP_ENV, str(tmp_path)))
    run = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-4000:]
    dumped = {p.name.split("-")[0] for p in dump.glob("*.ttgir")}
    assert {"simple_state_fwd", "simple_output", "simple_state_pair", "simple_dqk"} <= dumped, dumped
    ptx = next(dump.glob("simple_output-*.ptx")).read_text()
    assert ".target sm_90" in ptx and "ld.global" in ptx
