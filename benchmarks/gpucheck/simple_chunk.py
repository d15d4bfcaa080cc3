"""GPU check of the chunked scalar-decay kernels (``ejkernel_triton._simple_chunk``: ``lightning_attn`` and
``recurrent`` without a key gate, registered as ``triton_chunk``) on an H200.

(a) correctness: ``ejkernel.modules.lightning_attn`` and ``ejkernel.modules.recurrent`` (scalar gate ``g``) forced
    onto ``triton_chunk`` against ``ejkernel.testing.reference`` on the same inputs (matmuls at full float32
    precision): the output, the final state and the gradients of every float input (``slope`` or ``g``, and
    ``initial_state``), dense at B2 T1024 H4 K=V=128 and packed (T1031, a one-token and an empty sequence, a
    boundary mid-chunk, tokens after the last), bfloat16 and float32; relative (norm) and max abs errors, PASS/FAIL
    at the conformance suite's tolerances (the final state and the float32 inputs' gradients at float32 tolerance);
(b) timings (``ejkernel.ops.timing.time_fn``: median, ``jax.block_until_ready``) at B4 T4096 H16 K=V=128 bf16,
    no initial state: ``lightning_attn`` forward and forward + backward (the loss ``sum(o * r)``, gradients in q, k,
    v, slope) for ``triton_chunk`` and ``xla``, in ms and in ``ejkernel bench``'s TFLOP/s; then ``simple_gla``
    itself at a few launch plans (tiles of 64 or 128 channels, 4 or 8 warps).

``--plans-only``: (b)'s launch plans alone. ``--small``: tiny shapes, a dry run of the script on a CPU
(``EJKERNEL_TRITON_INTERPRET=1``).

Run (on the GPU machine, repo root; .whl carried):
    bash .ci/gpu setup >/dev/null && PYTHONPATH=/tmp/ejk-site python3 benchmarks/gpucheck/simple_chunk.py
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.modules import lightning_attn, recurrent
from ejkernel.ops.timing import time_fn
from ejkernel.testing import reference
from ejkernel.testing.conformance._harness import FWD_RTOL, GRAD_RTOL

SMALL = "--small" in sys.argv
# --small: the CPU registration of the same kernels (in Triton's interpreter)
IMPL, BACKEND = ("triton_chunk_interpret", "cpu") if SMALL else ("triton_chunk", "gpu")
PLANS_ONLY = "--plans-only" in sys.argv  # (b) alone, and only the launch plans


def inputs(op, b, t, h, dk, dv, dtype, *, n=None, seed=0, h0=True):
    rng = np.random.default_rng(seed)

    def normal(*shape, dt=dtype):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dt)

    q, k, v = normal(b, t, h, dk), normal(b, t, h, dk), normal(b, t, h, dv)
    if op == "lightning_attn":
        gate = jnp.asarray(rng.uniform(0.01, 0.5, h).astype(np.float32))
    else:
        gate = jnp.asarray(-np.logaddexp(0.0, -rng.standard_normal((b, t, h))).astype(np.float32) / 4)
    s0 = normal(n or b, h, dk, dv, dt=jnp.float32) if h0 else None
    return q, k, v, gate, s0


def outputs_and_grads(fn, q, k, v, gate, s0, cu, seed=1):
    rng = np.random.default_rng(seed)
    r_o = jnp.asarray(rng.standard_normal(v.shape, dtype=np.float32))
    r_s = jnp.asarray(rng.standard_normal(s0.shape, dtype=np.float32))

    def loss(q, k, v, gate, s0):
        o, st = fn(q, k, v, gate, initial_state=s0, output_final_state=True, cu_seqlens=cu)
        return jnp.sum(o.astype(jnp.float32) * r_o) + jnp.sum(st * r_s), (o, st)

    (_, (o, st)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(q, k, v, gate, s0)
    return (o, st, *grads)


def rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)), float(np.max(np.abs(got - want)))


def check(op, name, dtype, cu=None):
    n = None if cu is None else len(cu) - 1
    b, t, hd = (2, 1024, 128) if cu is None else (1, 1031, 128)
    if SMALL:
        t, hd, cu = (100, 32, None) if cu is None else (70, 32, (0, 1, 30, 30, 60, 66))
    args = inputs(op, b, t, 4, hd, hd, dtype, n=n)
    cu_ = None if cu is None else jnp.asarray(cu, jnp.int32)
    module = {"lightning_attn": lightning_attn, "recurrent": recurrent}[op]
    got = outputs_and_grads(lambda *a, **kw: module(*a, **kw, platform=IMPL, backend=BACKEND), *args, cu_)
    with jax.default_matmul_precision("highest"):  # the reference computes in float32 (the same inputs)
        want = outputs_and_grads(getattr(reference, op), *args, cu_)
    d = jnp.dtype(dtype).name
    gate = "dslope" if op == "lightning_attn" else "dg"
    ok_all = True
    for what, x, w, tol in zip(
        ("o", "final", "dq", "dk", "dv", gate, "dh0"),
        got,
        want,
        (FWD_RTOL[d], FWD_RTOL["float32"] * t / 16, *(GRAD_RTOL[d],) * 3, *(GRAD_RTOL["float32"] * 10,) * 2),
        strict=True,
    ):
        r, a = rel(x, w)
        ok = r <= tol and bool(np.all(np.isfinite(np.asarray(x, np.float32))))
        ok_all &= ok
        print(
            f"  {op:14s} {name:6s} {d:8s} {what:6s} rel {r:9.2e} (tol {tol:7.1e}) max abs {a:9.2e} "
            f"{'PASS' if ok else 'FAIL'}"
        )
    if cu_ is not None:
        end = int(cu_[-1])
        zero = bool(np.all(np.asarray(got[0][:, end:]) == 0) and np.all(np.asarray(got[2][:, end:]) == 0))
        ok_all &= zero
        print(
            f"  {op:14s} {name:6s} {d:8s} tokens after the last sequence: o = 0 and dq = 0 {'PASS' if zero else 'FAIL'}"
        )
    return ok_all


def flops(b, t, h, dk, dv, fwd_bwd):
    """``ejkernel bench``'s count for the linear-attention ops (``ejkernel.bench.cases._linear_flops``)."""
    return 2.0 * b * t * h * (2 * dk * dv + 64 * (dk + dv)) * (3.0 if fwd_bwd else 1.0)


def report(label, fwd, fb, args, r, shape):
    try:
        t_f = time_fn(fwd, *args)
        t_fb = time_fn(fb, *args, r)
    except Exception as e:  # noqa: BLE001
        print(f"  {label:30s} failed: {type(e).__name__}: {str(e)[:300]}")
        return
    tf_f, tf_fb = flops(*shape, False) / t_f / 1e12, flops(*shape, True) / t_fb / 1e12
    print(f"  {label:30s} fwd {t_f * 1e3:8.3f} ms ({tf_f:6.1f} TFLOP/s)   fwd+bwd {t_fb * 1e3:8.3f} ms ({tf_fb:6.1f})")


def with_loss(fwd):
    def loss(q, k, v, gate, r):
        return jnp.sum(fwd(q, k, v, gate).astype(jnp.float32) * r)

    return jax.jit(fwd), jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))


def main():
    print("devices:", jax.devices())
    if not PLANS_ONLY:
        print("(a) correctness against the float32 reference")
        ok = True
        for op in ("lightning_attn", "recurrent"):
            for dtype in (jnp.bfloat16, jnp.float32):
                ok &= check(op, "dense", dtype)
                ok &= check(op, "packed", dtype, cu=(0, 1, 400, 400, 900, 1020))
        print("ALL PASS" if ok else "SOME FAILED")

    shape = (1, 128, 2, 32, 32) if SMALL else (4, 4096, 16, 128, 128)
    print(f"(b) timings, lightning_attn B{shape[0]} T{shape[1]} H{shape[2]} K={shape[3]} V={shape[4]} bf16")
    q, k, v, slope, _ = inputs("lightning_attn", *shape, jnp.bfloat16, h0=False)
    r = jnp.asarray(np.random.default_rng(2).standard_normal(v.shape, dtype=np.float32))
    for platform in (IMPL, "xla"):
        if (SMALL and platform == "xla") or PLANS_ONLY:
            continue

        def fwd(q, k, v, slope, platform=platform):
            return lightning_attn(q, k, v, slope, platform=platform, backend=BACKEND)[0]

        report(f"lightning_attn {platform}", *with_loss(fwd), (q, k, v, slope), r, shape)
    print("  (flash-linear-attention chunk_simple_gla on an H200: forward about 81 TFLOP/s)")

    from ejkernel_triton import _simple_chunk as simple
    from ejkernel_triton.gla.chunk import ChunkBwdParams, ChunkFwdParams

    g = jnp.broadcast_to(-slope, q.shape[:3])
    print("plans (simple_gla; ChunkFwdParams / ChunkBwdParams fields):")
    plans = {
        "default": ({}, {}),
        "fwd bv=128": ({"block_v": 128}, {}),
        "fwd bk=128": ({"block_k": 128}, {}),
        "fwd bk=bv=128 w8": ({"block_k": 128, "block_v": 128, "num_warps": 8}, {}),
        "fwd w8": ({"num_warps": 8}, {}),
        "bwd w4": ({}, {"num_warps": 4}),
        "bwd bk=128": ({}, {"block_k": 128}),
        "bwd bv=128": ({}, {"block_v": 128}),
        "bwd bk=bv=32": ({}, {"block_k": 32, "block_v": 32}),
        "chunk 32": ({"chunk_size": 32}, {"chunk_size": 32}),
        "bwd w4 bk=128": ({}, {"num_warps": 4, "block_k": 128}),
        "bwd w4 bv=128": ({}, {"num_warps": 4, "block_v": 128}),
        "bwd w4 bk=bv=32": ({}, {"num_warps": 4, "block_k": 32, "block_v": 32}),
        "bwd w4 stages 1": ({}, {"num_warps": 4, "num_stages": 1}),
        "bwd w4 stages 3": ({}, {"num_warps": 4, "num_stages": 3}),
        "fwd bv=128 stages 3": ({"block_v": 128, "num_stages": 3}, {}),
    }
    if PLANS_ONLY:  # the new ones
        plans = dict(list(plans.items())[:1] + list(plans.items())[-6:])
    for name, (fp, bp) in plans.items():
        kw = {"fwd_params": ChunkFwdParams(**fp), "bwd_params": ChunkBwdParams(**bp)}

        def fwd_plan(q, k, v, g, kw=kw):
            return simple.simple_gla(q, k, v, g, **kw)[0]

        report(name, *with_loss(fwd_plan), (q, k, v, g), r, shape)


if __name__ == "__main__":
    main()
