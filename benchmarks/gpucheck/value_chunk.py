"""GPU check of the chunked value-gate kernels (``ejkernel_triton._value_chunk``: ``recurrent`` with a value gate
``g_v`` and no key gate, registered as ``triton_value_chunk``) on an H200.

(a) correctness: ``ejkernel.modules.recurrent`` with ``g`` and ``g_v`` forced onto ``triton_value_chunk`` against XLA's
    implementation on the same inputs (B2 T1024 H4 K=V=128, bfloat16 and float32, with an initial and a final
    state): the output, the final state and every gradient, relative (norm) error, PASS/FAIL at the conformance
    suite's tolerances;
(b) timings (``ejkernel.ops.timing.time_fn``) at B4 T4096 H16 K=V=128 bf16: forward and forward + backward (the loss
    ``sum(o * r)``, gradients in q, k, v, g, g_v) for ``triton_value_chunk`` and ``xla``, in ms and in ``ejkernel bench``'s
    TFLOP/s for the linear-attention ops.

``--small``: tiny shapes, a dry run on a CPU (``EJKERNEL_TRITON_INTERPRET=1``).

Run (on the GPU machine, repo root; .whl carried):
    bash .ci/gpu setup >/dev/null && PYTHONPATH=/tmp/ejk-site python3 benchmarks/gpucheck/value_chunk.py
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.modules import recurrent
from ejkernel.ops.timing import time_fn
from ejkernel.testing.conformance._harness import FWD_RTOL, GRAD_RTOL

SMALL = "--small" in sys.argv
IMPL, BACKEND = ("triton_value_chunk_interpret", "cpu") if SMALL else ("triton_value_chunk", "gpu")


def inputs(b, t, h, dk, dv, dtype, seed=0):
    rng = np.random.default_rng(seed)

    def normal(*shape, dt=dtype):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dt)

    def log_gate(*shape):  # log_sigmoid, as the conformance suite's gates
        return jnp.asarray(-np.logaddexp(0.0, -rng.standard_normal(shape) - 2.0).astype(np.float32))

    return normal(b, t, h, dk), normal(b, t, h, dk), normal(b, t, h, dv), log_gate(b, t, h), log_gate(b, t, h, dv)


def call(platform, q, k, v, g, g_v, s0=None, final=False):
    return recurrent(
        q, k, v, g=g, g_v=g_v, initial_state=s0, output_final_state=final, platform=platform, backend=BACKEND
    )


def outputs_and_grads(platform, q, k, v, g, g_v, s0, r_o, r_s):
    def loss(q, k, v, g, g_v, s0):
        o, st = call(platform, q, k, v, g, g_v, s0, True)
        return jnp.sum(o.astype(jnp.float32) * r_o) + jnp.sum(st * r_s), (o, st)

    (_, (o, st)), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))(q, k, v, g, g_v, s0)
    return (o, st, *grads)


def rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def check(dtype):
    b, t, h, d = (1, 100, 2, 32) if SMALL else (2, 1024, 4, 128)
    q, k, v, g, g_v = inputs(b, t, h, d, d, dtype)
    rng = np.random.default_rng(1)
    s0 = jnp.asarray(rng.standard_normal((b, h, d, d), dtype=np.float32))
    r_o = jnp.asarray(rng.standard_normal(v.shape, dtype=np.float32))
    r_s = jnp.asarray(rng.standard_normal(s0.shape, dtype=np.float32))
    got = outputs_and_grads(IMPL, q, k, v, g, g_v, s0, r_o, r_s)
    want = outputs_and_grads("xla", q, k, v, g, g_v, s0, r_o, r_s)
    ok = True
    for name, a, w in zip(("o", "final", "dq", "dk", "dv", "dg", "dg_v", "dh0"), got, want):
        tol = FWD_RTOL[dtype] if name in ("o", "final") else GRAD_RTOL[dtype]
        err = rel(a, w)
        ok &= err <= tol
        print(f"  {dtype:9s} {name:6s} rel {err:9.2e} (tol {tol:.1e}) {'PASS' if err <= tol else 'FAIL'}")
    return ok


def flops(b, t, h, dk, dv, fwd_bwd, c=64):
    """``ejkernel bench``'s count for the linear-attention ops (chunked form, chunk 64; forward + backward 3x)."""
    return 2 * b * t * h * (2 * dk * dv + c * (dk + dv)) * (3 if fwd_bwd else 1)


def main():
    print("(a) correctness against XLA's recurrent (g and g_v)")
    ok = all([check("bfloat16"), check("float32")])
    print("ALL PASS" if ok else "SOME FAIL")
    if SMALL:
        return
    b, t, h, d = 4, 4096, 16, 128
    q, k, v, g, g_v = inputs(b, t, h, d, d, "bfloat16")
    r = jnp.asarray(np.random.default_rng(2).standard_normal(v.shape, dtype=np.float32))
    print(f"(b) timings, recurrent with g and g_v, B{b} T{t} H{h} K=V={d} bf16")
    for platform in (IMPL, "xla"):

        def fwd(q, k, v, g, g_v, platform=platform):
            return call(platform, q, k, v, g, g_v)[0]

        def fb(q, k, v, g, g_v, r, fwd=fwd):
            return jax.grad(lambda *x: jnp.sum(fwd(*x).astype(jnp.float32) * r), argnums=(0, 1, 2, 3, 4))(
                q, k, v, g, g_v
            )

        t_f = time_fn(jax.jit(fwd), q, k, v, g, g_v)
        t_fb = time_fn(jax.jit(fb), q, k, v, g, g_v, r)
        tf_f, tf_fb = flops(b, t, h, d, d, False) / t_f / 1e12, flops(b, t, h, d, d, True) / t_fb / 1e12
        print(
            f"  {platform:14s} fwd {t_f * 1e3:8.3f} ms ({tf_f:6.1f} TFLOP/s)   fwd+bwd {t_fb * 1e3:8.3f} ms ({tf_fb:6.1f})"
        )


if __name__ == "__main__":
    main()
