"""The XLA linear-attention engine behind gla / lightning_attn / recurrent: every chunk size agrees.

The conformance suites run the heuristic's choice; here each form is forced through the launch
parameters (chunk 1 = the step-by-step recurrence with its own backward), forward and backward apart.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.ops import Invocation
from ejkernel.testing import reference
from ejkernel.testing.conformance._harness import assert_close, fresh_key
from ejkernel.testing.conformance._linear_attention import Case, base_inputs, log_gate, outputs_and_grads

from ejkernel_xla import _linear_attention as engine
from ejkernel_xla.params import ChunkParams
from ejkernel_xla.recurrent import candidate_cfgs, heuristic_cfg, recurrent


@pytest.mark.parametrize(("fwd_chunk", "bwd_chunk"), [(1, 1), (4, 32), (32, 1)])
def test_every_chunk_size_matches_the_reference(fwd_chunk, bwd_chunk):
    # Packed lengths 5, 0 and 26 visited backwards, every gate, initial and final states.
    case = Case("all", b=1, t=33, h=2, dk=8, dv=4, cu_seqlens=(0, 5, 5, 31))
    _, seed = fresh_key()
    rng = np.random.default_rng(seed)
    arrays = base_inputs(case, "float32", rng)
    arrays["g"] = log_gate(rng, (1, 33, 2), 0.2)
    arrays["g_k"] = log_gate(rng, (1, 33, 2, 8), 0.2)
    arrays["g_v"] = log_gate(rng, (1, 33, 2, 4), 0.2)
    options = {"output_final_state": True, "reverse": True}
    params = {"fwd_params": ChunkParams(chunk_size=fwd_chunk), "bwd_params": ChunkParams(chunk_size=bwd_chunk)}
    got = outputs_and_grads(lambda **kw: recurrent(**kw, **params), arrays, options, seed)
    want = outputs_and_grads(reference.recurrent, arrays, options, seed)
    assert_close(got[0], want[0], 2e-5, "output", seed)
    assert_close(got[1], want[1], 2e-5, "final state", seed)
    for name in want[2]:
        assert_close(got[2][name], want[2][name], 1e-4, f"d{name}", seed)


@pytest.mark.parametrize("strong", [-200.0, -np.inf])
def test_strong_gates_take_the_exact_step_by_step_form(strong):
    # One log gate of -200 (or -inf: forget everything) inside a chunk: the chunked form's factors would
    # overflow, so the engine falls back to the recurrence, which gives the reference exactly.
    _, seed = fresh_key()
    rng = np.random.default_rng(seed)
    arrays = base_inputs(Case("strong", b=1, t=40, h=1, dk=4, dv=4), "float32", rng)
    g_k = np.asarray(log_gate(rng, (1, 40, 1, 4), 0.1)).copy()
    g_k[0, 20, 0, :] = strong
    chunk = engine.chunk_size(None, 40)
    padded = jnp.asarray(np.pad(g_k, ((0, 0), (0, chunk - 40), (0, 0), (0, 0))))
    assert not bool(engine._fits(engine._prefix(engine._blocks(padded, chunk)), None))
    o, state = recurrent(**arrays, g_k=jnp.asarray(g_k), output_final_state=True)
    o_ref, state_ref = reference.recurrent(**arrays, g_k=jnp.asarray(g_k), output_final_state=True)
    assert np.all(np.isfinite(np.asarray(o)))
    assert_close(o, o_ref, 2e-5, "output", seed)
    assert_close(state, state_ref, 2e-5, "final state", seed)

    # Gradients too: the chunked form still runs (outside the cond, on zero gates) and gets a zero
    # cotangent, which must not turn into NaN.
    def loss(fn, q, k, v, g):
        o, state = fn(**{**arrays, "q": q, "k": k, "v": v}, g_k=g, output_final_state=True)
        return jnp.sum(jnp.sin(o)) + jnp.sum(jnp.cos(state))

    args = (arrays["q"], arrays["k"], arrays["v"], jnp.asarray(g_k))
    got = jax.grad(lambda *a: loss(recurrent, *a), argnums=(0, 1, 2, 3))(*args)
    want = jax.grad(lambda *a: loss(reference.recurrent, *a), argnums=(0, 1, 2, 3))(*args)
    for name, a, b in zip(("dq", "dk", "dv", "dg_k"), got, want, strict=True):
        assert np.all(np.isfinite(np.asarray(a))), name
        assert_close(a, b, 1e-4, name, seed)


def test_heuristic_and_candidates():
    def inv(t: int) -> Invocation:
        return Invocation.create("recurrent", {"q": jax.ShapeDtypeStruct((1, t, 2, 8), jnp.float32)}, "cpu")

    assert heuristic_cfg(inv(1), "fwd") == ChunkParams(chunk_size=1)  # decoding: step by step
    assert heuristic_cfg(inv(4096), "bwd") == ChunkParams(chunk_size=engine.DEFAULT_CHUNK)
    assert heuristic_cfg(inv(37), "fwd") == ChunkParams(chunk_size=64)
    assert [p.chunk_size for p in candidate_cfgs(inv(4096), "fwd")] == [1, 16, 32, 64, 128]
    assert [p.chunk_size for p in candidate_cfgs(inv(20), "fwd")] == [1, 16, 32]
    assert engine.chunk_size(100, 4096) == 64  # rounded down to a power of two
    with pytest.raises(ValueError, match="chunk size"):
        engine.chunk_size(0, 10)
