"""ejkernel-triton's chunked ``gated_delta_rule`` (``ejkernel_triton.gated_delta_rule.chunk``), forward and backward,
in Triton's interpreter.

The conformance suite checks the contract; this file checks what is particular to the chunked kernels: chunks of
several sizes with a partial last one, value channels split over programs, grouped value heads, strong gates,
packed sequences with an empty one, bfloat16 inputs, every gradient against the reference's VJP in those cases,
``vmap`` folded into one launch (forward and backward), the candidates, what ``supports`` declines, the
registration above XLA on GPUs, near-equal keys (powers of ``A`` that grow, a tame ``(I + A)^-1``), and that
every kernel compiles for sm_90.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed: the Triton interpreter tests need it", allow_module_level=True)

os.environ["EJKERNEL_TRITON_INTERPRET"] = "1"  # before anything imports triton

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ejkernel.kernels import kernel_registry  # noqa: E402
from ejkernel.ops import Invocation  # noqa: E402
from ejkernel.testing import reference  # noqa: E402

from ejkernel_triton import launch  # noqa: E402
from ejkernel_triton.gated_delta_rule import chunk  # noqa: E402
from ejkernel_triton.gla.chunk import ChunkBwdParams, ChunkFwdParams  # noqa: E402


def _inputs(b, t, h, hv, dk, dv, *, n=None, seed=0, gate_shift=3.0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape).astype(np.float32))

    q, k, v = normal(b, t, h, dk), normal(b, t, h, dk), normal(b, t, hv, dv)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)  # keys of norm 1 keep the rule stable
    g = -jax.nn.softplus(-(normal(b, t, hv) + gate_shift))
    beta = jax.nn.sigmoid(normal(b, t, hv))
    return (q.astype(dtype), k.astype(dtype), v.astype(dtype), g, beta), 0.5 * normal(n or b, hv, dk, dv)


def _rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize(
    ("shape", "params", "kw"),
    [
        ((2, 37, 2, 4, 16, 32), ChunkFwdParams(), {}),  # chunks of 16, the last partial; grouped value heads
        ((1, 70, 1, 1, 32, 48), ChunkFwdParams(chunk_size=32, block_v=16), {"use_qk_l2norm": True}),  # 3 value blocks
        ((1, 20, 2, 2, 16, 16), ChunkFwdParams(chunk_size=64), {"gate_shift": -3.0}),  # one chunk, strong gates
        # value blocks of 64 (the second partial) and the state pass's of 32 (few states: _plan), V = 80
        ((1, 40, 1, 1, 16, 80), ChunkFwdParams(block_v=64), {}),
    ],
)
def test_outputs_and_final_state_match_reference(shape, params, kw):
    kw = dict(kw)
    args, h0 = _inputs(*shape, gate_shift=kw.pop("gate_shift", 3.0))
    o, final = chunk.gated_delta_rule(*args, initial_state=h0, output_final_state=True, fwd_params=params, **kw)
    want_o, want_final = reference.gated_delta_rule(*args, initial_state=h0, output_final_state=True, **kw)
    assert _rel(o, want_o) < 1e-5 and _rel(final, want_final) < 1e-5


def test_packed_sequences_bfloat16():
    """Lengths 5, 0, 25 and 3 tokens in none; bfloat16 inputs (output in bfloat16, final state float32). The
    forward's dots take bfloat16 operands here (the state, ``U'`` and ``T`` rounded as on a GPU), as
    flash-linear-attention's do: about 1% off the float32 reference (0.4% with float32 operands)."""
    args, h0 = _inputs(1, 33, 2, 2, 16, 16, n=3, seed=2, dtype=jnp.bfloat16)
    cu = jnp.asarray([0, 5, 5, 30], jnp.int32)
    o, final = chunk.gated_delta_rule(*args, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    want_o, want_final = reference.gated_delta_rule(*args, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert o.dtype == jnp.bfloat16 and final.dtype == jnp.float32
    assert _rel(o, want_o) < 2e-2 and _rel(final, want_final) < 1e-2
    assert np.all(np.asarray(o[0, 30:], np.float32) == 0)  # tokens outside every sequence: zeros


def test_near_equal_keys_stay_accurate():
    """Near-equal keys, beta near 1, almost no decay: ``(I + A)^-1`` is tame but the powers of ``A`` grow like
    binomial coefficients (a product form ``(I - A)(I + A^2)...`` of the inverse was off by 1e9 here at chunks
    of 64)."""
    rng = np.random.default_rng(3)
    k1 = rng.standard_normal(16) / 4.0
    k = jnp.asarray(k1 + 1e-3 * rng.standard_normal((1, 64, 1, 16)), jnp.float32)
    q, v = (jnp.asarray(rng.standard_normal((1, 64, 1, 16)), jnp.float32) for _ in range(2))
    g, beta = jnp.full((1, 64, 1), -1e-3, jnp.float32), jnp.full((1, 64, 1), 0.95, jnp.float32)
    o, final = chunk.gated_delta_rule(
        q, k, v, g, beta, output_final_state=True, fwd_params=ChunkFwdParams(chunk_size=64)
    )
    want_o, want_final = reference.gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    assert _rel(o, want_o) < 1e-5 and _rel(final, want_final) < 1e-5


def _vjps(fn, args, h0, cu, output_final_state, kw, seed=7):
    """``fn``'s gradients of every input (``initial_state`` when given) for random cotangents of the output and,
    with ``output_final_state``, of the final state."""
    rng = np.random.default_rng(seed)
    primals = (*args, h0) if h0 is not None else args

    def f(*xs):
        o, final = fn(*xs[:5], initial_state=xs[5] if h0 is not None else None, cu_seqlens=cu, **kw)
        return (o, final) if output_final_state else o

    out, vjp = jax.vjp(f, *primals)
    o = out[0] if output_final_state else out
    do = jnp.asarray(rng.standard_normal(o.shape).astype(np.float32)).astype(o.dtype)
    if not output_final_state:
        return vjp(do)
    return vjp((do, jnp.asarray(rng.standard_normal(out[1].shape).astype(np.float32))))


@pytest.mark.parametrize(
    ("shape", "params", "kw"),
    [
        # chunks of 16, the last partial; grouped value heads; initial and final state
        ((2, 37, 2, 4, 16, 32), ChunkBwdParams(), {}),
        # 3 value blocks; chunks of 32; use_qk_l2norm
        ((1, 40, 1, 2, 16, 48), ChunkBwdParams(chunk_size=32, block_v=16), {"use_qk_l2norm": True}),
        # strong gates, one partial chunk of 64, no initial state, no final state (no state cotangent)
        ((1, 20, 2, 2, 16, 16), ChunkBwdParams(chunk_size=64), {"gate_shift": -3.0, "h0": False, "final": False}),
        # packed: lengths 5, 0, 25 and 3 tokens in none; initial and final state
        ((1, 33, 2, 2, 16, 16), ChunkBwdParams(), {"cu": (0, 5, 5, 30)}),
        # bfloat16 q, k, v (float32 gates): gradients in the inputs' dtypes, rounded
        ((1, 37, 1, 2, 16, 16), ChunkBwdParams(), {"dtype": jnp.bfloat16}),
    ],
    ids=["grouped-partial-chunk", "value-blocks-l2norm", "strong-gates-no-state", "packed-empty", "bfloat16"],
)
def test_gradients_match_reference_vjp(shape, params, kw):
    """dq, dk, dv, dg, dbeta and dh0 of the chunked backward against ``jax.vjp`` of the reference."""
    kw = dict(kw)
    cu = kw.pop("cu", None)
    cu = None if cu is None else jnp.asarray(cu, jnp.int32)
    dtype = kw.pop("dtype", jnp.float32)
    has_h0, final = kw.pop("h0", True), kw.pop("final", True)
    args, h0 = _inputs(*shape, n=None if cu is None else len(cu) - 1, gate_shift=kw.pop("gate_shift", 3.0), dtype=dtype)
    h0 = h0 if has_h0 else None
    kw["output_final_state"] = final

    def fn(*a, **k):
        return chunk.gated_delta_rule(*a, bwd_params=params, **k)

    got = _vjps(fn, args, h0, cu, final, kw)
    want = _vjps(reference.gated_delta_rule, args, h0, cu, final, kw)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2  # bfloat16: the dots' operands too (about 1% off)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want, strict=False):
        assert a.dtype == b.dtype, (name, a.dtype, b.dtype)
        assert _rel(a, b) < tol, (name, _rel(a, b))
    if cu is not None:  # tokens outside every sequence get no gradient
        assert all(np.all(np.asarray(x[0, 30:], np.float32) == 0) for x in got[:5])


def test_vmap_folds_into_one_launch(monkeypatch):
    batches: dict[str, list[int]] = {"_forward_rows": [], "_backward_rows": []}
    for name, seen in batches.items():
        rows = getattr(chunk, name)
        monkeypatch.setattr(
            chunk, name, lambda s, tab, *a, rows=rows, seen=seen: seen.append(tab.n) or rows(s, tab, *a)
        )
    args, h0 = _inputs(2, 5, 1, 1, 16, 16, seed=8)

    def f(*xs):
        return chunk.gated_delta_rule(*xs[:-1], initial_state=xs[-1], output_final_state=True)

    def loss(*xs):
        o, final = f(*xs)
        return jnp.sum(o * o) + jnp.sum(final)

    eager = f(*args, h0)
    mapped = jax.vmap(f)(*(x[:, None] for x in (*args, h0)))
    for got, want in zip(mapped, eager, strict=True):
        np.testing.assert_allclose(np.asarray(got[:, 0]), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert batches["_forward_rows"][-1] == 2, batches  # one launch for the 2 elements of one batch row each
    eager = jax.grad(loss, argnums=tuple(range(6)))(*args, h0)
    mapped = jax.vmap(jax.grad(loss, argnums=tuple(range(6))))(*(x[:, None] for x in (*args, h0)))
    for got, want in zip(mapped, eager, strict=True):
        np.testing.assert_allclose(np.asarray(got[:, 0]), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert batches["_backward_rows"][-1] == 2, batches  # the backward too


def test_candidates_supports_and_registration_below_xla_on_gpus():
    s = jax.ShapeDtypeStruct
    args = {
        "q": s((1, 8, 2, 128), jnp.bfloat16),
        "k": s((1, 8, 2, 128), jnp.bfloat16),
        "v": s((1, 8, 2, 128), jnp.bfloat16),
        "g": s((1, 8, 2), jnp.float32),
        "beta": s((1, 8, 2), jnp.float32),
    }
    inv = Invocation.create("gated_delta_rule", args, "cpu")
    for stage, cls in (("fwd", ChunkFwdParams), ("bwd", ChunkBwdParams)):
        cands = chunk.candidate_cfgs(inv, stage)
        assert cands[0] == chunk.heuristic_cfg(inv, stage) and len(set(cands)) == len(cands) >= 2
        assert all(type(p) is cls for p in cands)
        # chunks of 64 run the backward at 2 warps (fla saw its WY backward miscompiled on Hopper at 4)
        assert all(p.num_warps == 2 for p in cands if stage == "bwd" and p.chunk_size == 64)
    assert chunk._plan(128, 128, ChunkBwdParams(chunk_size=64)).num_warps == 2
    plan = chunk._plan(128, 128, ChunkBwdParams(state_warps=8, state_stages=4))  # the state passes' own launch
    assert (plan.state_warps, plan.state_stages, plan.num_warps) == (8, 4, 4)
    assert chunk.supports(inv) is None
    with pytest.raises(ValueError, match="block_k must be None or 128"):
        chunk.gated_delta_rule(*_inputs(1, 4, 1, 1, 128, 16)[0], fwd_params=ChunkFwdParams(block_k=64))
    with pytest.raises(TypeError, match="expected ChunkBwdParams"):
        chunk.gated_delta_rule(*_inputs(1, 4, 1, 1, 16, 16)[0], bwd_params=ChunkFwdParams())
    assert "beta dtype int32" in chunk.supports(
        Invocation.create("gated_delta_rule", {**args, "beta": s((1, 8, 2), jnp.int32)}, "cpu")
    )
    assert "head dims" in chunk.supports(
        Invocation.create("gated_delta_rule", {**args, "q": s((1, 8, 2, 512), jnp.bfloat16)}, "cpu")
    )
    wide = Invocation.create(
        "gated_delta_rule", {**args, **{n: s((1, 8, 2, 256), jnp.bfloat16) for n in ("q", "k", "v")}}, "cpu"
    )
    assert chunk.supports(wide) is None  # the interpreter has no shared-memory limit
    with pytest.MonkeyPatch.context() as mp:  # on a GPU, K=256 takes its own plans (sm_90's shared memory)
        mp.setattr(chunk, "interpreting", lambda: False)
        assert chunk.supports(wide) is None and chunk.supports(inv) is None  # K=256 checked on the H200

        def plan(dk: int, p: Any, dtype: Any = jnp.bfloat16, states: int | None = None) -> tuple[int, ...]:
            return dataclasses.astuple(chunk._plan(dk, dk, p, dtype, states))[:5]

        # (chunk, block_v, warps, stages, state_v), timed on the H200 (2026-12-04)
        assert plan(256, ChunkFwdParams()) == plan(256, ChunkBwdParams()) == (32, 64, 4, 2, 64)  # bfloat16
        assert plan(256, ChunkFwdParams(), jnp.float32) == (64, 32, 8, 2, 32)  # float32: fewer spills, fits sm_90
        assert plan(256, ChunkBwdParams(), jnp.float16) == (32, 16, 8, 3, 16)  # float16: float32 operands
        for stage in ("fwd", "bwd"):  # each checked by ptxas_report for sm_90
            cands = chunk.candidate_cfgs(wide, stage)
            assert cands[0] == chunk.heuristic_cfg(wide, stage) and len(set(cands)) == len(cands) == 5
            assert all(p.block_v <= 32 for p in cands[1:]), cands  # value blocks of 64 overflow for float32
        assert plan(128, ChunkFwdParams()) == (64, 64, 4, 2, 64) and plan(128, ChunkBwdParams()) == (32, 32, 4, 3, 32)
        # the forward state pass's value blocks halve when it has fewer than 128 programs (B2 H16: 64 at 64); the
        # other launches keep block_v, a given one too
        assert (
            plan(128, ChunkFwdParams(), states=32)[1::3] == (64, 32) and plan(128, ChunkFwdParams(), states=64)[4] == 64
        )
        assert plan(128, ChunkFwdParams(block_v=64), states=32)[1::3] == (64, 32)
        assert plan(128, ChunkFwdParams(block_v=16), states=32)[1::3] == (16, 16)
        assert plan(128, ChunkBwdParams(), states=32)[1::3] == (32, 32)  # the backward's state pass: its block_v
        narrowed = chunk._plan(128, 128, ChunkFwdParams(), jnp.bfloat16, 32)  # bfloat16: at 3 stages (timed)
        assert (narrowed.state_stages, chunk._plan(128, 128, ChunkFwdParams(), jnp.float32, 32).state_stages) == (3, 0)
    gpu = {i.name: i.priority for i in kernel_registry.implementations("gated_delta_rule", backend="gpu")}
    if "xla" in gpu:
        assert gpu["xla"] < gpu["triton_chunk"] < gpu["triton"], gpu  # faster than XLA on the H200; decode: recurrent
    cpu = {i.name: i.priority for i in kernel_registry.implementations("gated_delta_rule", backend="cpu")}
    assert cpu["triton_chunk_interpret"] == 1


_COMPILE_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from ejkernel_triton import launch
    from ejkernel_triton.gated_delta_rule.chunk import gated_delta_rule
    from ejkernel_triton.gla.chunk import ChunkBwdParams
    assert not launch.INTERPRET
    z = lambda *shape, dt=jnp.bfloat16: jnp.zeros(shape, dt)
    # Each launch compiles for sm_90 and returns zeros. The backward at K = V = 128 only (the largest tiles: the
    # shared-memory check), at its default (chunks of 32, value blocks of 32, 4 warps; 3 stages) spelled out.
    bwd = ChunkBwdParams(chunk_size=32, block_v=32, num_warps=4)
    for b, t, h, hv, dk, dv, grad in ((4, 4096, 16, 16, 128, 128, True), (1, 256, 2, 4, 64, 256, False)):
        args = (z(b, t, h, dk), z(b, t, h, dk), z(b, t, hv, dv), z(b, t, hv, dt=jnp.float32), z(b, t, hv, dt=jnp.float32))
        out, vjp = jax.vjp(lambda *a: gated_delta_rule(*a, output_final_state=True, bwd_params=bwd), *args)
        if grad:
            vjp(out)
    print("compiled")
""")


def test_kernels_compile_for_sm90():
    # The interpreter is not the compiler: in a fresh process without interpreter mode, compile every kernel for
    # sm_90 as jax-triton types them, and check shared memory (launch.COMPILE_ONLY_ENV).
    env = {k: v for k, v in os.environ.items() if k not in ("EJKERNEL_TRITON_INTERPRET", "TRITON_INTERPRET")}
    env[launch.COMPILE_ONLY_ENV] = "90"
    run = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-4000:]


_COMPILE_WIDE_SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, triton
    from ejkernel_triton import launch
    from ejkernel_triton.gated_delta_rule.chunk import gated_delta_rule
    assert not launch.INTERPRET
    real = triton.compile
    def compile_(src, target=None, options=None):
        compiled = real(src, target=target, options=options)
        print(f"{src.fn.__name__} {compiled.metadata.shared}", flush=True)
        return compiled
    triton.compile = compile_
    launch.shared_memory_per_block = lambda _: 1 << 62  # the test judges each kernel's shared memory itself
    # K = V = 256 at the default plans (no launch parameters): the key tiles of 256 channels. Shapes barely change
    # what is compiled (B1 H1 T64 is one chunk of the forward, two of the backward); dtypes do.
    dt = jnp.dtype(sys.argv[1])
    z = lambda *shape, dt=dt: jnp.zeros(shape, dt)
    args = (z(1, 64, 1, 256), z(1, 64, 1, 256), z(1, 64, 1, 256), z(1, 64, 1, dt=jnp.float32), z(1, 64, 1, dt=jnp.float32))
    out, vjp = jax.vjp(lambda *a: gated_delta_rule(*a, output_final_state=True, use_qk_l2norm=True), *args)
    vjp(out)
    print("compiled")
""")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])  # float32: the forward's state pass is the largest
def test_wide_keys_fit_sm90_shared_memory(dtype):
    """K = 256 on a GPU: every kernel of the default plans compiles for sm_90 within its 232448 bytes of shared
    memory per block (the plans ``_plan`` picks for key dims above 128). About 20-40 s each on two cores."""
    from ejkernel.device import shared_memory_per_block

    env = {k: v for k, v in os.environ.items() if k not in ("EJKERNEL_TRITON_INTERPRET", "TRITON_INTERPRET")}
    env[launch.COMPILE_ONLY_ENV] = "90"
    run = subprocess.run(
        [sys.executable, "-c", _COMPILE_WIDE_SCRIPT, dtype], env=env, capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-4000:]
    shared = [(name, int(n)) for name, n in (line.split() for line in run.stdout.splitlines() if line != "compiled")]
    want = {"delta_prep", "delta_states", "delta_output", "delta_state_bwd", "delta_bwd_grads"}
    assert {name for name, _ in shared} == want, shared
    assert all(n <= shared_memory_per_block((9, 0)) for _, n in shared), shared  # 232448 bytes
