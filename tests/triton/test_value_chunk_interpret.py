"""ejkernel-triton's chunked value-gate kernels (``ejkernel_triton._value_chunk``) in Triton's interpreter.

Through ``recurrent.value_chunk`` (``g`` and ``g_v``: one log decay per value channel) against the reference recurrence: the
output, the final state and the gradients of every input (both gates' too), float32 and bfloat16, with and without
an initial and a final state, head dims padded and tiled, T not a multiple of the chunk, packing with a one-token
and an empty sequence, strong decays, ``reverse``; a key gate with a value gate is declined; which kernels run;
and that every kernel compiles for sm_90.
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

from ejkernel.testing import reference  # noqa: E402

from ejkernel_triton import launch  # noqa: E402
from ejkernel_triton.gla.chunk import ChunkBwdParams, ChunkFwdParams  # noqa: E402
from ejkernel_triton.recurrent import chunk as chunked  # noqa: E402
from ejkernel_triton.recurrent import value_chunk as rec  # noqa: E402

NAMES = ("o", "final", "dq", "dk", "dv", "dg", "dg_v", "dh0")


def _inputs(b, t, h, dk, dv, dtype, *, n=None, seed=0, gate_scale=0.25):
    """``(q, k, v, g, g_v), h0``: log decays ``g`` small (a tenth of ``g_v``'s scale), ``g_v`` about
    ``-gate_scale`` a token."""
    rng = np.random.default_rng(seed)

    def normal(*shape, dt=dtype):
        return jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dt)

    def log_decay(*shape, s):
        return jnp.asarray(s * -np.logaddexp(0.0, -rng.standard_normal(shape)), jnp.float32)

    q, k, v = normal(b, t, h, dk), normal(b, t, h, dk), normal(b, t, h, dv)
    g, g_v = log_decay(b, t, h, s=gate_scale / 10), log_decay(b, t, h, dv, s=gate_scale)
    return (q, k, v, g, g_v), normal(n or b, h, dk, dv, dt=jnp.float32)


def _outputs_and_grads(fn, args, h0, *, with_h0=True, final=True, **kw):
    """Output, final state (None when not asked for), gradients of ``q, k, v, g, g_v`` (and ``h0``)."""
    rng = np.random.default_rng(1)
    r_o = jnp.asarray(rng.standard_normal(args[2].shape), jnp.float32)
    r_s = jnp.asarray(rng.standard_normal(h0.shape), jnp.float32)

    def loss(q, k, v, g, g_v, h0):
        o, s = fn(q, k, v, g, None, g_v, initial_state=h0 if with_h0 else None, output_final_state=final, **kw)
        return jnp.sum(o.astype(jnp.float32) * r_o) + (jnp.sum(s * r_s) if final else 0.0), (o, s)

    (_, (o, s)), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))(*args, h0)
    return (o, s, *grads[:5], grads[5] if with_h0 else None)


def _rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def _check(got, want, dtype, f32_tol=2e-6):
    # bfloat16 inputs: their own dtype's outputs and gradients at bfloat16 accuracy; the float32 ones (final state,
    # the gates' and the initial state's gradients) at about float32 accuracy
    errors = {}
    for name, x, w in zip(NAMES, got, want, strict=True):
        if w is None:
            assert x is None, name
            continue
        assert x.dtype == w.dtype, name
        assert np.all(np.isfinite(np.asarray(x, np.float32))), name
        tol = 2e-2 if x.dtype == jnp.bfloat16 else (1e-4 if dtype == jnp.bfloat16 else f32_tol)
        errors[name] = _rel(x, w)
        assert errors[name] < tol, (name, errors[name])
    return errors


def _params(**p):
    return {"fwd_params": ChunkFwdParams(**p), "bwd_params": ChunkBwdParams(**p)}


@pytest.mark.parametrize(
    ("with_h0", "final", "dtype"),
    [(True, True, jnp.float32), (True, True, jnp.bfloat16), (False, False, jnp.float32)],
    ids=["h0_final-f32", "h0_final-bf16", "plain-f32"],
)
def test_dense_matches_reference(with_h0, final, dtype):
    """K != V, T = 41 over chunks of 32 (a partial chunk of 9 rows: a partial 16-row block), 16-channel tiles over
    padded head dims (20 -> 32, 24 -> 32)."""
    args, h0 = _inputs(2, 41, 1, 20, 24, dtype, seed=3)
    kw = {"with_h0": with_h0, "final": final}
    got = _outputs_and_grads(rec.recurrent, args, h0, **kw, **_params(chunk_size=32, block_k=16, block_v=16))
    _check(got, _outputs_and_grads(reference.recurrent, args, h0, **kw), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_packed_matches_reference(dtype):
    """Lengths 1, 16, 0 and 20 in chunks of 16 (every boundary after the first mid-chunk); tokens 37..40 are in no
    sequence: zero output and gradients there."""
    cu = jnp.asarray([0, 1, 17, 17, 37], jnp.int32)
    args, h0 = _inputs(1, 41, 2, 16, 24, dtype, n=4, seed=5)
    got = _outputs_and_grads(rec.recurrent, args, h0, cu_seqlens=cu, **_params(chunk_size=16))
    _check(got, _outputs_and_grads(reference.recurrent, args, h0, cu_seqlens=cu), dtype)
    for x in (got[0], *got[2:7]):
        assert np.all(np.asarray(x)[:, 37:] == 0)
    np.testing.assert_array_equal(np.asarray(got[1][2]), np.asarray(h0[2]))  # the empty sequence keeps its state


def test_strong_decay():
    """``g_v`` about -8 a token (cumulative exponents of -500 inside a chunk of 64: nothing overflows), float32,
    the default plan; the gates' gradients at 1e-4 (the diagonal pairs left out of them: see ``value_dv``)."""
    args, h0 = _inputs(1, 70, 2, 16, 16, jnp.float32, seed=4, gate_scale=8.0)
    got = _outputs_and_grads(rec.recurrent, args, h0)
    errors = _check(got, _outputs_and_grads(reference.recurrent, args, h0), None, f32_tol=1e-5)
    assert errors["dg_v"] < 1e-4 and errors["dg"] < 1e-4, errors


def test_reverse_matches_reference():
    """``reverse=True`` (the flipped sequence, through ``ejkernel_triton._gates.call_gla``), packed."""
    cu = jnp.asarray([0, 5, 30], jnp.int32)
    args, h0 = _inputs(1, 30, 1, 16, 16, jnp.float32, n=2, seed=6)
    kw = {"cu_seqlens": cu, "reverse": True}
    got = _outputs_and_grads(rec.recurrent, args, h0, **kw, **_params(chunk_size=16))
    _check(got, _outputs_and_grads(reference.recurrent, args, h0, **kw), None, f32_tol=1e-5)


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


def test_routing_and_both_gates_declined():
    """A value gate runs the value-side kernels (with or without ``g``); a key gate with it is declined, by
    ``supports`` and by a direct call; calls without one are ``triton_chunk``'s, which declines the value gate."""
    (q, k, v, g, g_v), _ = _inputs(1, 20, 1, 16, 16, jnp.float32, seed=2)
    fwd = {"chunk_gate_cumsum", "chunk_state_fwd", "value_output"}
    assert _kernels(lambda: rec.recurrent(q, k, v, g_v=g_v)) == fwd
    assert _kernels(lambda: rec.recurrent(q, k, v, g, g_v=g_v, reverse=True)) == fwd
    bwd = {"chunk_state_bwd", "value_pairs", "value_dv", "value_dqk"}
    assert _kernels(lambda: jax.grad(lambda v: rec.recurrent(q, k, v, g_v=g_v)[0].sum())(v)) == fwd | bwd
    assert rec.supports({"q": q, "k": k, "v": v, "g_v": g_v}) is None
    assert "no value gate" in rec.supports({"q": q, "k": k, "v": v, "g": g})
    assert "triton_value_chunk" in chunked.supports({"q": q, "k": k, "v": v, "g_v": g_v})
    reason = rec.supports({"q": q, "k": k, "v": v, "g_k": jnp.zeros_like(q), "g_v": g_v})
    assert reason is not None and "g_k" in reason and "g_v" in reason
    with pytest.raises(ValueError, match="g_k together with a value gate g_v"):
        rec.recurrent(q, k, v, g_k=jnp.zeros_like(q), g_v=g_v)
    cfg = rec.heuristic_cfg({"q": q, "v": v, "g_v": g_v})
    assert isinstance(cfg, ChunkFwdParams) and cfg.chunk_size == 64


_COMPILE_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from ejkernel_triton import launch
    from ejkernel_triton._value_chunk import value_gla
    assert not launch.INTERPRET

    def grads(b, t, h, dk, dv, dtype):
        z = lambda *shape, dt=dtype: jnp.zeros(shape, dt)

        def loss(q, k, v, gv, h0):
            o, s = value_gla(q, k, v, gv, initial_state=h0, output_final_state=True)
            return o.astype(jnp.float32).sum() + s.sum()

        args = (z(b, t, h, dk), z(b, t, h, dk), z(b, t, h, dv), z(b, t, h, dv, dt=jnp.float32), z(b, h, dk, dv, dt=jnp.float32))
        jax.grad(loss, argnums=tuple(range(5)))(*args)

    grads(2, 256, 2, 128, 128, jnp.bfloat16)  # the default plans
    grads(1, 128, 1, 256, 256, jnp.float32)  # float32 dots (three tf32 passes), the largest head dims
    print("compiled")
""")


def test_kernels_compile_for_sm90():
    # The interpreter is not the compiler: compile every kernel of both passes for sm_90 as jax-triton types them
    # (launch.COMPILE_ONLY_ENV), in a fresh process without interpreter mode; shared memory is checked too.
    env = {k: v for k, v in os.environ.items() if k not in ("EJKERNEL_TRITON_INTERPRET", "TRITON_INTERPRET")}
    env[launch.COMPILE_ONLY_ENV] = "90"
    run = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-4000:]
