"""ejkernel-triton's chunked ``gla`` (``ejkernel_triton.gla.chunk``) in Triton's interpreter.

The conformance suite checks the contract (forward, final state, every gradient, packing, grouped value heads,
strong gates); this file checks what is particular to the chunked kernels: state tiles split over programs along
both head dims (up to 256, padded ones too) with several sub-blocks per chunk, packed sequences at chunks of 64 cut
in blocks of 16 rows (strong gates too), ``vmap`` folded into one launch,
``cu_seqlens`` out of range under ``jit`` (clamped, never read outside the call), the plans and candidates a GPU
gets, the launch parameters' errors, what ``supports`` declines, the registration below XLA on GPUs, and that every kernel
compiles for sm_90.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
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

from ejkernel.kernels import kernel_registry  # noqa: E402
from ejkernel.kernels.params import BwdParams, FwdParams  # noqa: E402
from ejkernel.ops import Invocation  # noqa: E402
from ejkernel.testing import reference  # noqa: E402

from ejkernel_triton import launch  # noqa: E402
from ejkernel_triton.gla import chunk  # noqa: E402


def _inputs(b, t, h, hv, dk, dv, *, n=None, seed=0, gate_scale=0.25):
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape).astype(np.float32))

    q, k, v = normal(b, t, h, dk), normal(b, t, h, dk), normal(b, t, hv, dv)
    g = jnp.asarray(gate_scale * -np.logaddexp(0.0, -rng.standard_normal((b, t, hv, dk))), jnp.float32)
    return (q, k, v, g), normal(n or b, hv, dk, dv)


def _outputs_and_grads(fn, args, h0, **kw):
    rng = np.random.default_rng(1)
    o_shape = args[2].shape[:3] + (args[2].shape[-1],)
    r_o = jnp.asarray(rng.standard_normal(o_shape), jnp.float32)
    r_s = jnp.asarray(rng.standard_normal(h0.shape), jnp.float32)

    def loss(*xs):
        o, final = fn(*xs[:-1], initial_state=xs[-1], output_final_state=True, **kw)
        return jnp.sum(o * r_o) + jnp.sum(final * r_s), (o, final)

    (_, outs), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(5)), has_aux=True))(*args, h0)
    return (*outs, *grads)


def _pair_backward_walks(monkeypatch) -> list[int]:
    """The backward's state walks paired (``Plan.paired_states``); the list gets one entry per paired launch."""
    plan, pair, calls = chunk.default_plan, chunk._state_pair, []
    monkeypatch.setattr(
        chunk, "default_plan", lambda d, stage="fwd": dataclasses.replace(plan(d, stage), paired_states=stage == "bwd")
    )
    monkeypatch.setattr(chunk, "_state_pair", lambda *a: calls.append(1) or pair(*a))
    return calls


def _rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize(
    ("dk", "dv", "params", "bwd_chunk"),
    [
        # odd head dims padded (20 -> 32, 40 -> 64), split into 16-channel tiles (state tiles too), two sub-blocks
        # per chunk
        (20, 40, {"chunk_size": 32, "block_k": 16, "block_v": 16}, None),
        # the largest head dims: 4 x 4 key/value tiles and 2 x 4 state tiles (the heuristic's), one partial chunk
        (256, 256, {}, None),
        # the backward cuts other chunks than the forward (so it computes the gates and the intra-chunk scores
        # again instead of taking the forward's)
        (40, 24, {"chunk_size": 32}, 16),
    ],
    ids=["padded_split", "head_dim_256", "other_backward_chunks"],
)
def test_state_tiles_split_over_programs(dk, dv, params, bwd_chunk, monkeypatch):
    paired = _pair_backward_walks(monkeypatch) if bwd_chunk is None else [1]  # the backward's walks in one launch
    if "block_k" in params:
        monkeypatch.setattr(chunk, "_state_tile", lambda d: (params["block_k"], params["block_v"]))
    args, h0 = _inputs(1, 40, 1, 2, dk, dv, seed=dk)
    fp = chunk.ChunkFwdParams(**params)
    bp = chunk.ChunkBwdParams(**{**params, **({} if bwd_chunk is None else {"chunk_size": bwd_chunk})})
    got = _outputs_and_grads(chunk.gla, args, h0, fwd_params=fp, bwd_params=bp)
    want = _outputs_and_grads(reference.gla, args, h0)
    for name, g, w in zip(("o", "final", "dq", "dk", "dv", "dg", "dh0"), got, want, strict=True):
        assert g.dtype == w.dtype, name
        assert _rel(g, w) < 1e-5, (name, _rel(g, w))
    assert paired


@pytest.mark.parametrize(
    ("gate_scale", "paired"),
    [(0.25, False), (30.0, False), (0.25, True)],
    ids=["gates", "strong_gates", "paired_walks"],
)
def test_packed_sequences_by_blocks(gate_scale, paired, monkeypatch):
    """Packed like the GPU checks, chunks of 64 cut in blocks of 16 rows (``chunk_intra_diag``,
    ``chunk_intra_offdiag``, ``chunk_dqk_intra``): a one-token sequence, sequences starting off any block boundary, an empty one, last chunks of 10 and 23 rows
    (partial blocks, blocks with no valid row), a whole chunk, tokens after the last; strong gates too (a block's
    reference row must be a valid row, else ``exp(-b)`` overflows into the scores and the gradients)."""
    calls = _pair_backward_walks(monkeypatch) if paired else []  # the backward's walks in one launch (not yet default)
    cu = (0, 1, 75, 75, 226, 290)
    args, h0 = _inputs(1, 300, 1, 2, 32, 16, n=len(cu) - 1, seed=5, gate_scale=gate_scale)
    cu_ = jnp.asarray(cu, jnp.int32)
    got = _outputs_and_grads(chunk.gla, args, h0, cu_seqlens=cu_)
    want = _outputs_and_grads(reference.gla, args, h0, cu_seqlens=cu_)
    for name, g, w in zip(("o", "final", "dq", "dk", "dv", "dg", "dh0"), got, want, strict=True):
        assert np.isfinite(np.asarray(g)).all() and _rel(g, w) < 1e-4, (name, _rel(g, w))
    assert len(calls) == paired


def test_decayed_keys_give_the_same_forward(monkeypatch):
    """``Plan.decayed_keys``: the forward's state walk reads the decayed keys that ``chunk_intra_diag`` writes
    instead of ``k`` and the gates; the output must be bit for bit the one of the walk that decays them itself
    (bfloat16 dots; packed sequences with partial chunks, grouped value heads); with a final state (split products)
    it is not used. The sm_90 compile test compiles it for float32 dots too."""
    launches = []
    real = launch.launch
    monkeypatch.setattr(
        launch, "launch", lambda kern, *a, **kw: launches.append(kw.get("DECAYED")) or real(kern, *a, **kw)
    )
    cu = jnp.asarray((0, 23, 23, 75), jnp.int32)
    (q, k, v, g), h0 = _inputs(1, 80, 1, 2, 32, 16, n=3, seed=9)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    fp = chunk.ChunkFwdParams(chunk_size=16)  # several chunks per sequence: the walk's states reach the output
    plan = chunk.default_plan

    def run(decayed, final=False):
        monkeypatch.setattr(
            chunk, "default_plan", lambda d, stage="fwd": dataclasses.replace(plan(d, stage), decayed_keys=decayed)
        )
        launches.clear()
        out = chunk.gla(q, k, v, g, initial_state=h0, cu_seqlens=cu, output_final_state=final, fwd_params=fp)
        return out, [d for d in launches if d is not None]

    (o_want, _), walks = run(False)
    assert walks == [False]
    (o_got, _), walks = run(True)
    assert walks == [True]
    assert o_got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(o_got, np.float32)[:, :75], np.asarray(o_want, np.float32)[:, :75])
    _, walks = run(True, final=True)
    assert walks == [False]


def test_vmap_folds_into_one_launch(monkeypatch):
    batches = []
    forward_rows = chunk._forward_rows
    monkeypatch.setattr(chunk, "_forward_rows", lambda s, tab, *a: batches.append(tab.n) or forward_rows(s, tab, *a))
    args, h0 = _inputs(2, 5, 1, 1, 16, 16, seed=8)

    def f(*xs):
        return chunk.gla(*xs[:-1], initial_state=xs[-1], output_final_state=True)

    eager = f(*args, h0)
    mapped = jax.vmap(f)(*(x[:, None] for x in (*args, h0)))
    for got, want in zip(mapped, eager, strict=True):
        np.testing.assert_allclose(np.asarray(got[:, 0]), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert batches[-1] == 2, batches  # one launch for the 2 elements of one batch row each


def test_cu_seqlens_out_of_range_under_jit_stays_inside_the_call():
    """Past T and decreasing: clamped into [0, T] and made non-decreasing (sequences 2 and 3 become empty)."""
    args, h0 = _inputs(1, 20, 1, 1, 16, 16, n=4, seed=3)
    cu = jnp.asarray([0, 12, 30, 5, 25], jnp.int32)
    run = jax.jit(lambda cu: chunk.gla(*args, initial_state=h0, output_final_state=True, cu_seqlens=cu))
    o, final = run(cu)
    want_o, want_final = reference.gla(
        *args, initial_state=h0, output_final_state=True, cu_seqlens=jnp.asarray([0, 12, 20, 20, 20], jnp.int32)
    )
    assert _rel(o, want_o) < 1e-5 and _rel(final, want_final) < 1e-5


def test_plans_on_a_gpu(monkeypatch):
    monkeypatch.setattr(chunk, "interpreting", lambda: False)
    d = chunk.Dims(128, 128, 4 * 16)  # B 4 x HV 16: 128 programs of [128, 64] state tiles
    fwd, bwd = chunk.default_plan(d, "fwd"), chunk.default_plan(d, "bwd")
    assert fwd == chunk.Plan(64, block_k=64, block_v=128, num_warps=8, num_stages=2, state_k=128, state_v=64)
    assert bwd == chunk.Plan(64, block_k=64, block_v=64, num_warps=8, num_stages=2, state_k=128, state_v=64)
    # fewer sequences x value heads: smaller state tiles, so the state passes still get about one wave of programs
    assert [chunk._state_tile(chunk.Dims(128, 128, n)) for n in (0, 32, 16, 2)] == [(128, 64), (64, 64), (64, 32)] + [
        (64, 32)
    ]
    # the state passes' launch: 8 warps, 2 stages on 128 x 64 tiles, 4 warps and 3 stages on smaller ones
    assert [
        (p.state_warps, p.state_stages)
        for p in map(chunk.default_plan, map(chunk.Dims, [128] * 3, [128] * 3, (64, 32, 16)))
    ] == [(8, 2), (4, 3), (4, 3)]
    for stage, base, n, key_tiles, value_tiles in (
        ("fwd", fwd, 14, {64}, {32, 64, 128}),
        ("bwd", bwd, 18, {32, 64}, {32, 64}),
    ):
        candidates = chunk._candidate_plans(d, stage)
        assert candidates[0] == base and len(candidates) == len(set(candidates)) == n
        assert {p.chunk for p in candidates} == {32, 64} and {p.block_v for p in candidates} == value_tiles
        assert {p.block_k for p in candidates} == key_tiles
        assert {(p.state_warps, p.state_stages) for p in candidates} == {(8, 2), (4, 2), (8, 3)}
    # the state passes' warps and stages are launch parameters of their own, validated, and kept by make_plan
    plan = chunk.make_plan(d, chunk.ChunkFwdParams(state_warps=2, state_stages=4))
    assert (plan.state_warps, plan.state_stages, plan.num_warps) == (2, 4, 8)
    with pytest.raises(ValueError, match="state_warps must be a power of two from 1 to 16"):
        chunk.ChunkBwdParams(state_warps=3)
    # small head dims: tiles of the padded dims; a requested tile larger than them is cut down
    d = chunk.Dims(20, 8)
    assert (chunk.default_plan(d).block_k, chunk.default_plan(d).block_v) == (32, 16)
    plan = chunk.make_plan(d, chunk.ChunkBwdParams(block_k=128, chunk_size=16), "bwd")
    assert (plan.chunk, plan.block_k, plan.block_v, plan.state_k, plan.state_v) == (16, 32, 16, 32, 16)
    # the heuristic's parameters give back its plan (the dispatcher passes them in), state tiles included
    d = chunk.Dims(128, 128, 64)
    for stage, cls in (("fwd", chunk.ChunkFwdParams), ("bwd", chunk.ChunkBwdParams)):
        assert chunk.make_plan(d, chunk._params(cls, chunk.default_plan(d, stage)), stage) == chunk.default_plan(
            d, stage
        )


def test_backward_takes_the_forwards_scores(monkeypatch):
    """The intra-chunk scores ``A`` and the cumulative gates (of float32 gates) are the forward's residuals: one
    launch of their kernels per forward and backward."""
    names = []
    real = launch.launch
    monkeypatch.setattr(
        launch, "launch", lambda kernel, *a, **kw: names.append(kernel.__name__) or real(kernel, *a, **kw)
    )
    args, _ = _inputs(1, 8, 1, 1, 16, 16)
    jax.grad(lambda q: chunk.gla(q, *args[1:])[0].sum())(args[0])
    assert (
        names.count("chunk_intra_diag") == names.count("chunk_intra_offdiag") == 1
        and names.count("chunk_state_bwd") == 1
    ), names
    assert names.count("chunk_gate_cumsum") == 1, names


def test_params_errors_and_generic_mapping():
    with pytest.raises(ValueError, match="ChunkFwdParams.chunk_size must be a power of two from 16 to 64"):
        chunk.ChunkFwdParams(chunk_size=48)
    with pytest.raises(ValueError, match="ChunkBwdParams.block_k must be a power of two from 16 to 256"):
        chunk.ChunkBwdParams(block_k=8)
    assert chunk.ChunkFwdParams.from_generic(FwdParams(q_blocksize=32, num_warps=8)) == chunk.ChunkFwdParams(
        chunk_size=32, num_warps=8
    )
    with pytest.raises(ValueError, match="kv_blocksize"):
        chunk.ChunkBwdParams.from_generic(BwdParams(kv_blocksize=32))
    args, _ = _inputs(1, 4, 1, 1, 16, 16)
    with pytest.raises(TypeError, match="expected ChunkFwdParams"):
        chunk.gla(*args, fwd_params=chunk.ChunkBwdParams())


def test_supports_and_registration_below_xla_on_gpus():
    def inv(t, dk=16, dtype=jnp.float32):
        s = jax.ShapeDtypeStruct
        args = {
            "q": s((1, t, 2, dk), dtype),
            "k": s((1, t, 2, dk), dtype),
            "v": s((1, t, 2, 16), dtype),
            "g": s((1, t, 2, dk), jnp.float32),
            "initial_state": None,
            "cu_seqlens": None,
        }
        return Invocation.create("gla", args, "cpu")

    assert chunk.supports(inv(1)) is None  # a decode step: one partly filled chunk
    assert chunk.supports(inv(4096, dk=256, dtype=jnp.bfloat16)) is None
    assert "head dims" in chunk.supports(inv(8, dk=512))
    assert "float64 is not supported" in chunk.supports(inv(8, dtype=jnp.float64))
    lightning = Invocation.create("lightning_attn", {**inv(8, dtype=jnp.float16).arguments, "g": None}, "cpu")
    assert chunk.supports(lightning) is None  # lightning_attn and recurrent run on these kernels
    assert "lightning_attn (chunked): head dims" in chunk.supports(
        Invocation.create("lightning_attn", inv(8, dk=512).arguments, "cpu")
    )  # the op is named in the message
    for op in ("gla", "lightning_attn", "recurrent"):
        gpu = {i.name: i.priority for i in kernel_registry.implementations(op, backend="gpu")}
        if "xla" in gpu:  # faster than XLA on an H200 (2026-12-04); gla's decode: its fused recurrent kernel
            assert gpu["xla"] < gpu["triton_chunk"], gpu
            assert op != "gla" or gpu["triton_chunk"] < gpu["triton"], gpu
            assert op != "recurrent" or gpu["xla"] < gpu["triton_value_chunk"], gpu  # the value gate's, too
        cpu = {i.name: i.priority for i in kernel_registry.implementations(op, backend="cpu")}
        assert cpu["triton_chunk_interpret"] == 1


_COMPILE_SCRIPT = textwrap.dedent("""
    import dataclasses
    import jax, jax.numpy as jnp
    from ejkernel_triton import launch
    from ejkernel_triton.gla import chunk
    from ejkernel_triton.gla.chunk import gla
    assert not launch.INTERPRET

    def grads(b, t, h, hv, dk, dv, dtype=jnp.bfloat16):
        z = lambda *shape, dt=dtype: jnp.zeros(shape, dt)

        def loss(q, k, v, g, h0):
            o, s = gla(q, k, v, g, initial_state=h0, output_final_state=True)
            return o.astype(jnp.float32).sum() + s.sum()

        args = (z(b, t, h, dk), z(b, t, h, dk), z(b, t, hv, dv), z(b, t, hv, dk, dt=jnp.float32), z(b, hv, dk, dv, dt=jnp.float32))
        jax.grad(loss, argnums=tuple(range(5)))(*args)

    grads(4, 4096, 16, 16, 128, 128)  # a training shape, the heuristic's plans (bfloat16 dots)
    grads(1, 256, 2, 4, 128, 128, jnp.float32)  # float32 dots (three tf32 passes), grouped value heads
    plan = chunk.default_plan  # the backward's state walks in one launch (chunk_state_pair)
    chunk.default_plan = lambda d, stage="fwd": dataclasses.replace(plan(d, stage), paired_states=stage == "bwd")
    grads(2, 64, 16, 16, 128, 128)  # 32 states: 64 x 64 state tiles at 4 warps, 3 stages (the B2 T16384 plan)
    grads(1, 256, 2, 4, 128, 128, jnp.float32)
    # the forward's walk of the decayed keys (no final state), bfloat16 and float32 dots
    chunk.default_plan = lambda d, stage="fwd": dataclasses.replace(plan(d, stage), decayed_keys=True)
    for b, t, h, hv, dt in ((2, 64, 16, 16, jnp.bfloat16), (1, 256, 2, 4, jnp.float32)):
        z = lambda *shape, dt=dt: jnp.zeros(shape, dt)
        gla(z(b, t, h, 128), z(b, t, h, 128), z(b, t, hv, 128), z(b, t, hv, 128, dt=jnp.float32))
    print("compiled")
""")


def test_kernels_compile_for_sm90():
    # The interpreter is not the compiler: in a fresh process without interpreter mode, compile every kernel of the
    # forward and the backward for sm_90 as jax-triton types them, and check shared memory (launch.COMPILE_ONLY_ENV).
    env = {k: v for k, v in os.environ.items() if k not in ("EJKERNEL_TRITON_INTERPRET", "TRITON_INTERPRET")}
    env[launch.COMPILE_ONLY_ENV] = "90"
    run = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-4000:]


def test_zero_fill_only_for_packed_tables():
    """Outputs are zero-filled before a launch only where rows may lie outside every sequence (cu_seqlens): a dense
    table's kernels write every row (the interpreter NaN-fills unzeroed outputs, so the dense conformance cases
    check that), and a fill is a pass over the whole output on a GPU."""
    assert chunk._chunk_table(2, 40, 16, None).zeroed(0, 1, 2) == ()
    assert chunk._chunk_table(1, 40, 16, jnp.asarray([0, 8, 30], jnp.int32)).zeroed(0, 1, 2) == (0, 1, 2)
