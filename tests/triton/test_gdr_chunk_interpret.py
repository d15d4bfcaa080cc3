"""ejkernel-triton's chunked ``gated_delta_rule`` forward (``ejkernel_triton.gated_delta_rule.chunk``) in Triton's
interpreter.

The conformance suite checks the contract; this file checks what is particular to the chunked kernels: chunks of
several sizes with a partial last one, value channels split over programs, grouped value heads, strong gates,
packed sequences with an empty one, bfloat16 inputs, ``vmap`` folded into one launch, the candidates, what
``supports`` declines, the registration below XLA on GPUs, and that every kernel compiles for sm_90.
"""

from __future__ import annotations

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
from ejkernel.ops import Invocation  # noqa: E402
from ejkernel.testing import reference  # noqa: E402

from ejkernel_triton import launch  # noqa: E402
from ejkernel_triton.gated_delta_rule import chunk  # noqa: E402
from ejkernel_triton.gla.chunk import ChunkFwdParams  # noqa: E402


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
    ],
)
def test_outputs_and_final_state_match_reference(shape, params, kw):
    kw = dict(kw)
    args, h0 = _inputs(*shape, gate_shift=kw.pop("gate_shift", 3.0))
    o, final = chunk.gated_delta_rule(*args, initial_state=h0, output_final_state=True, fwd_params=params, **kw)
    want_o, want_final = reference.gated_delta_rule(*args, initial_state=h0, output_final_state=True, **kw)
    assert _rel(o, want_o) < 1e-5 and _rel(final, want_final) < 1e-5


def test_packed_sequences_bfloat16_and_gradients():
    """Lengths 5, 0, 25 and 3 tokens in none; bfloat16 inputs (output in bfloat16, final state float32); the
    gradients (the reference's VJP) of every input."""
    args, h0 = _inputs(1, 33, 2, 2, 16, 16, n=3, seed=2, dtype=jnp.bfloat16)
    cu = jnp.asarray([0, 5, 5, 30], jnp.int32)
    o, final = chunk.gated_delta_rule(*args, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    want_o, want_final = reference.gated_delta_rule(*args, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert o.dtype == jnp.bfloat16 and final.dtype == jnp.float32
    assert _rel(o, want_o) < 1e-2 and _rel(final, want_final) < 1e-5
    assert np.all(np.asarray(o[0, 30:], np.float32) == 0)  # tokens outside every sequence: zeros

    def loss(fn, *xs):
        o, s = fn(*xs[:5], initial_state=xs[5], output_final_state=True, cu_seqlens=cu)
        return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(s)

    f32 = tuple(x.astype(jnp.float32) for x in (*args, h0))
    got = jax.grad(lambda *xs: loss(chunk.gated_delta_rule, *xs), argnums=tuple(range(6)))(*f32)
    want = jax.grad(lambda *xs: loss(reference.gated_delta_rule, *xs), argnums=tuple(range(6)))(*f32)
    for a, b in zip(got, want, strict=True):
        assert _rel(a, b) < 1e-5


def test_vmap_folds_into_one_launch(monkeypatch):
    batches = []
    forward_rows = chunk._forward_rows
    monkeypatch.setattr(chunk, "_forward_rows", lambda s, tab, *a: batches.append(tab.n) or forward_rows(s, tab, *a))
    args, h0 = _inputs(2, 5, 1, 1, 16, 16, seed=8)

    def f(*xs):
        return chunk.gated_delta_rule(*xs[:-1], initial_state=xs[-1], output_final_state=True)

    eager = f(*args, h0)
    mapped = jax.vmap(f)(*(x[:, None] for x in (*args, h0)))
    for got, want in zip(mapped, eager, strict=True):
        np.testing.assert_allclose(np.asarray(got[:, 0]), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert batches[-1] == 2, batches  # one launch for the 2 elements of one batch row each


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
    cands = chunk.candidate_cfgs(inv, "fwd")
    assert cands[0] == chunk.heuristic_cfg(inv, "fwd") and len(set(cands)) == len(cands) >= 2
    assert chunk.supports(inv) is None
    with pytest.raises(ValueError, match="block_k must be None or 128"):
        chunk.gated_delta_rule(*_inputs(1, 4, 1, 1, 128, 16)[0], fwd_params=ChunkFwdParams(block_k=64))
    assert "beta dtype int32" in chunk.supports(
        Invocation.create("gated_delta_rule", {**args, "beta": s((1, 8, 2), jnp.int32)}, "cpu")
    )
    assert "head dims" in chunk.supports(
        Invocation.create("gated_delta_rule", {**args, "q": s((1, 8, 2, 512), jnp.bfloat16)}, "cpu")
    )
    gpu = {i.name: i.priority for i in kernel_registry.implementations("gated_delta_rule", backend="gpu")}
    if "xla" in gpu:
        assert gpu["triton_chunk"] < gpu["xla"], gpu  # not run on a GPU yet, and its backward is the reference's
    cpu = {i.name: i.priority for i in kernel_registry.implementations("gated_delta_rule", backend="cpu")}
    assert cpu["triton_chunk_interpret"] == 1


_COMPILE_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from ejkernel_triton import launch
    from ejkernel_triton.gated_delta_rule.chunk import gated_delta_rule
    assert not launch.INTERPRET
    z = lambda *shape, dt=jnp.bfloat16: jnp.zeros(shape, dt)
    for b, t, h, hv, dk, dv in ((4, 4096, 16, 16, 128, 128), (1, 256, 2, 4, 64, 256)):
        args = (z(b, t, h, dk), z(b, t, h, dk), z(b, t, hv, dv), z(b, t, hv, dt=jnp.float32), z(b, t, hv, dt=jnp.float32))
        gated_delta_rule(*args, output_final_state=True)  # each launch compiles for sm_90 and returns zeros
    print("compiled")
""")


def test_kernels_compile_for_sm90():
    # The interpreter is not the compiler: in a fresh process without interpreter mode, compile every kernel for
    # sm_90 as jax-triton types them, and check shared memory (launch.COMPILE_ONLY_ENV).
    env = {k: v for k, v in os.environ.items() if k not in ("EJKERNEL_TRITON_INTERPRET", "TRITON_INTERPRET")}
    env[launch.COMPILE_ONLY_ENV] = "90"
    run = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-4000:]
