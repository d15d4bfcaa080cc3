"""GPU check of the chunked Triton ``gla`` (``ejkernel_triton.gla.chunk``, registered as ``triton_chunk``) on an H200.

(a) correctness: ``ejkernel.modules.gla`` forced onto ``triton_chunk`` (``platform="triton_chunk"``, as the
    conformance suite forces an implementation) against ``ejkernel.testing.reference.gla`` on the
    same inputs (it computes in float32; matmuls at full float32 precision): the output, the final state and the gradients of q, k, v, g and
    initial_state, dense at B2 T1024 H4 K=V=128 in bfloat16 and float32, and packed (T1031, cu_seqlens with a
    one-token and an empty sequence, tokens after the last) in both; max abs and relative (norm) errors, PASS/FAIL at the conformance
    suite's tolerances (the final state and the float32 inputs' gradients at float32 tolerance);
(b) timings (median of 20 after warmup, ``jax.block_until_ready``) at B4 T4096 H16 K=V=128 bf16 (g float32, no
    initial state), forward and forward + backward (the loss ``sum(o * r)`` with its gradients in q, k, v, g), for
    ``triton_chunk`` and ``xla``; with ``--plans`` also ``triton_chunk`` at a few launch plans (forward value
    tiles of 128, backward key tiles of 32 and value tiles of 32, forward chunks of 32); with ``--kernels`` each Triton launch of one
    forward + backward alone (5 calls a sample).

Run (on the GPU machine, repo root; .whl carried):
    bash .ci/gpu setup >/dev/null && PYTHONPATH=/tmp/ejk-site python3 benchmarks/gpucheck/gla_chunk.py [--plans] [--kernels] \
        [--shape B,T]  # (b)'s shape (default 4,4096)
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from _timing import median_ms  # benchmarks/gpucheck/_timing.py (the script's folder is on sys.path)

from ejkernel.kernels import kernel_registry
from ejkernel.modules import gla
from ejkernel.testing import reference
from ejkernel.testing.conformance._harness import FWD_RTOL, GRAD_RTOL

IMPL = "triton_chunk"
SMALL = "--small" in sys.argv  # a dry run of the script itself (tiny shapes; on a CPU with EJKERNEL_TRITON_INTERPRET=1)
B, T = (int(x) for x in sys.argv[sys.argv.index("--shape") + 1].split(",")) if "--shape" in sys.argv else (4, 4096)


def inputs(b, t, h, dk, dv, dtype, *, n=None, seed=0, h0=True):
    rng = np.random.default_rng(seed)

    def normal(*shape, dt=dtype):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dt)

    q, k, v = normal(b, t, h, dk), normal(b, t, h, dk), normal(b, t, h, dv)
    g = jnp.asarray(-np.logaddexp(0.0, -rng.standard_normal((b, t, h, dk))).astype(np.float32) / 16)
    s0 = normal(n or b, h, dk, dv, dt=jnp.float32) if h0 else None
    return q, k, v, g, s0


def outputs_and_grads(fn, q, k, v, g, s0, cu, seed=1):
    rng = np.random.default_rng(seed)
    r_o = jnp.asarray(rng.standard_normal(v.shape, dtype=np.float32))
    r_s = jnp.asarray(rng.standard_normal(s0.shape, dtype=np.float32))

    def loss(q, k, v, g, s0):
        o, st = fn(q, k, v, g, initial_state=s0, output_final_state=True, cu_seqlens=cu)
        return jnp.sum(o.astype(jnp.float32) * r_o) + jnp.sum(st * r_s), (o, st)

    (_, (o, st)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(q, k, v, g, s0)
    return (o, st, *grads)


def rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)), float(np.max(np.abs(got - want)))


def check(name, dtype, cu=None):
    n = None if cu is None else len(cu) - 1
    b = 2 if cu is None else 1
    t = 1024 if cu is None else 1031
    hd = 128
    if SMALL:
        t, hd, cu = (100, 32, None) if cu is None else (70, 32, (0, 1, 30, 30, 60, 66))
    args = inputs(b, t, 4, hd, hd, dtype, n=n)
    cu_ = None if cu is None else jnp.asarray(cu, jnp.int32)
    got = outputs_and_grads(lambda *a, **kw: gla(*a, **kw, platform=IMPL, backend="gpu"), *args, cu_)
    with jax.default_matmul_precision("highest"):  # the reference computes in float32 (the same inputs)
        want = outputs_and_grads(reference.gla, *args, cu_)
    d = jnp.dtype(dtype).name
    ok_all = True
    for what, x, w, tol in zip(
        ("o", "final", "dq", "dk", "dv", "dg", "dh0"),
        got,
        want,
        (FWD_RTOL[d], FWD_RTOL["float32"] * t / 16, *(GRAD_RTOL[d],) * 3, *(GRAD_RTOL["float32"] * 10,) * 2),
        strict=True,
    ):
        r, a = rel(x, w)
        ok = r <= tol and bool(np.all(np.isfinite(np.asarray(x, np.float32))))
        ok_all &= ok
        print(f"  {name:6s} {d:8s} {what:5s} rel {r:9.2e} (tol {tol:7.1e}) max abs {a:9.2e} {'PASS' if ok else 'FAIL'}")
    if cu_ is not None:
        end = int(cu_[-1])
        zero = bool(np.all(np.asarray(got[0][:, end:]) == 0) and np.all(np.asarray(got[2][:, end:]) == 0))
        ok_all &= zero
        print(f"  {name:6s} {d:8s} tokens after the last sequence: o = 0 and dq = 0 {'PASS' if zero else 'FAIL'}")
    return ok_all


def timed_calls(platform):
    def fwd(q, k, v, g):
        return gla(q, k, v, g, platform=platform, backend="gpu")[0]

    def loss(q, k, v, g, r):
        return jnp.sum(fwd(q, k, v, g).astype(jnp.float32) * r)

    fb = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))
    return jax.jit(fwd), jax.jit(fb)


def plan_times(q, k, v, g, r):
    """Forward and forward + backward of ``ejkernel_triton.gla.chunk.gla`` at a few launch plans (``--plans``)."""
    from ejkernel_triton.gla import chunk

    fwd_bwd = {
        "default": ({}, {}),
        "fwd block_v=128": ({"block_v": 128}, {}),
        # key tiles of 32 in the forward (chunk_intra_offdiag's; chunk_intra_diag takes all key channels at once)
        "fwd block_k=32": ({"block_k": 32}, {}),
        "fwd bk=32 bwd bk=32": ({"block_k": 32}, {"block_k": 32}),
        "bwd block_v=32": ({}, {"block_v": 32}),
        "bwd block_k=32": ({}, {"block_k": 32}),
        "fwd bv=128 bwd bk=32": ({"block_v": 128}, {"block_k": 32}),
        "fwd chunk=32": ({"chunk_size": 32}, {}),
    }
    for name, (fp, bp) in fwd_bwd.items():
        kw = {"fwd_params": chunk.ChunkFwdParams(**fp), "bwd_params": chunk.ChunkBwdParams(**bp)}

        def fwd(q, k, v, g, kw=kw):
            return chunk.gla(q, k, v, g, **kw)[0]

        def loss(q, k, v, g, r, fwd=fwd):
            return jnp.sum(fwd(q, k, v, g).astype(jnp.float32) * r)

        t_f = median_ms(jax.jit(fwd), q, k, v, g)
        t_fb = median_ms(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))), q, k, v, g, r)
        print(f"  {name:22s} fwd {t_f:8.3f}   fwd+bwd {t_fb:8.3f}")


def kernel_times(args):
    """Each Triton launch of one forward + backward, alone (recorded eagerly, replayed under jit)."""
    from ejkernel_triton import launch
    from ejkernel_triton.gla import chunk

    calls = []
    real = launch.launch

    def record(kernel, *a, **kw):
        calls.append((kernel, a, kw))
        return real(kernel, *a, **kw)

    launch.launch = record
    try:
        q, k, v, g = args
        b, t, h, dk = q.shape
        s = chunk.Static(
            chunk.make_plan(chunk.Dims(dk, v.shape[-1], b * v.shape[2]), chunk.ChunkFwdParams(), "fwd"),
            chunk.make_plan(chunk.Dims(dk, v.shape[-1], b * v.shape[2]), chunk.ChunkBwdParams(), "bwd"),
            dk**-0.5,
            False,
        )
        rows = [chunk._rows(x) for x in (q, k, v, g)]
        _, _, a, gc = jax.block_until_ready(
            chunk._forward_rows(s, chunk._chunk_table(b, t, s.fwd.chunk, None), *rows, None)
        )
        do = jnp.ones(rows[2].shape, v.dtype)
        tab = chunk._chunk_table(b, t, s.bwd.chunk, None)
        # the backward as the custom VJP runs it: the forward's A and cumulative gates as residuals
        jax.block_until_ready(chunk._backward_rows(s, tab, *rows, None, do, None, a, gc))
    finally:
        launch.launch = real
    total = 0.0
    for kernel, a, kw in calls:
        at = [i for i, x in enumerate(a) if isinstance(x, jax.Array)]

        def one(*arrays, a=a, at=at, kernel=kernel, kw=kw):
            full = list(a)
            for i, x in zip(at, arrays, strict=True):
                full[i] = x
            return real(kernel, *full, **kw)

        ms = median_ms(jax.jit(one), *(a[i] for i in at), reps=5)  # 5 calls a sample: past the timer's floor
        total += ms
        print(f"  {kw.get('name', kernel.__name__):36s} grid {str(kw['grid']):18s} {ms:8.3f} ms")
    print(f"  {'sum':36s} {'':23s} {total:8.3f} ms")


def main():
    print("devices:", jax.devices())
    impls = {i.name: i.priority for i in kernel_registry.implementations("gla", backend="gpu")}
    print("gla on gpu (name: priority):", impls)
    assert IMPL in impls, f"{IMPL} is not registered for the GPU"

    print("(a) correctness against the float32 reference")
    ok = True
    for dtype in (jnp.bfloat16, jnp.float32):
        ok &= check("dense", dtype)
        ok &= check("packed", dtype, cu=(0, 1, 400, 400, 900, 1020))
    print("ALL PASS" if ok else "SOME FAILED")

    print(f"(b) timings, B{B} T{T} H16 K=V=128 bf16, median of 20 (ms)")
    q, k, v, g, _ = inputs(*((1, 128, 2, 32, 32) if SMALL else (B, T, 16, 128, 128)), jnp.bfloat16, h0=False)
    r = jnp.asarray(np.random.default_rng(2).standard_normal(v.shape, dtype=np.float32))
    for platform in (IMPL, "xla"):
        if SMALL and platform == "xla":
            continue
        fwd, fb = timed_calls(platform)
        try:
            t_f = median_ms(fwd, q, k, v, g)
            t_fb = median_ms(fb, q, k, v, g, r)
            print(f"  {platform:13s} fwd {t_f:8.3f}   fwd+bwd {t_fb:8.3f}")
        except Exception as e:  # noqa: BLE001
            print(f"  {platform:13s} failed: {type(e).__name__}: {str(e)[:300]}")
    print("  (flash-linear-attention chunk_gla on an H200: fwd ~0.9-1.0, fwd+bwd ~4.15)")
    if "--plans" in sys.argv:
        print("plans (triton_chunk, ChunkFwdParams / ChunkBwdParams fields):")
        plan_times(q, k, v, g, r)
    if "--kernels" in sys.argv:
        print("per launch (triton_chunk; the backward recomputes the chunk states):")
        kernel_times((q, k, v, g))


if __name__ == "__main__":
    main()
