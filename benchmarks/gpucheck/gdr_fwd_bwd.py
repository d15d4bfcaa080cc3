"""The gated delta rule's forward+backward on a GPU: XLA's chunked implementation against the Triton chunked one
at its default and its backward candidates (B4 T4096 H16 K=V=128 bf16, ``use_qk_l2norm``; ``--shape B,T`` for
another batch and length, e.g. ``2,16384``; ``--dims K,V`` for other head dims, e.g. ``256,256``, whose plans ``supports`` declines on a GPU until
this script has passed with them). The gradients of ``sum(out * cotangent)`` (and the forward's output,
under several forward launches) are compared with XLA's (max abs error over max abs, per argument), then timed
(median of 15, ``jax.block_until_ready``). ``ejkernel bench``'s own check of this pass needs the float32 reference's VJP,
which holds the state token by token (65 GiB here), hence this script.

Run on the GPU machine after ``bash .ci/gpu setup``: ``PYTHONPATH=/tmp/ejk-site python3
benchmarks/gpucheck/gdr_fwd_bwd.py [--shape B,T] [--dims K,V] [--fwd-only]`` (``--fwd-only``: the forward plans alone).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from _timing import median_ms  # benchmarks/gpucheck/_timing.py (the script's folder is on sys.path)

from ejkernel_triton.gated_delta_rule import chunk
from ejkernel_triton.gla.chunk import ChunkBwdParams
from ejkernel_xla.gated_delta_rule.interface import gated_delta_rule as xla_gdr

B, T, H, K, V = 4, 4096, 16, 128, 128
if "--shape" in sys.argv:
    B, T = (int(x) for x in sys.argv[sys.argv.index("--shape") + 1].split(","))
if "--dims" in sys.argv:
    K, V = (int(x) for x in sys.argv[sys.argv.index("--dims") + 1].split(","))


def ms(f, *args):
    return median_ms(f, *args, n=15, warmup=1)


def main():
    print(f"B{B} T{T} H{H} K{K} V{V} bfloat16, use_qk_l2norm", flush=True)
    rng = np.random.default_rng(0)
    bf = jnp.bfloat16
    q = jnp.asarray(rng.standard_normal((B, T, H, K)), bf)
    k = jnp.asarray(rng.standard_normal((B, T, H, K)), bf)
    v = jnp.asarray(rng.standard_normal((B, T, H, V)), bf)
    g = jnp.asarray(-jax.nn.softplus(-(rng.standard_normal((B, T, H)) + 3)), jnp.float32)
    beta = jnp.asarray(jax.nn.sigmoid(rng.standard_normal((B, T, H))), jnp.float32)
    ct = jnp.asarray(rng.standard_normal((B, T, H, V)), bf)
    args = (q, k, v, g, beta)

    def grad_of(fn):
        def loss(*a):
            out, _ = fn(*a, use_qk_l2norm=True)
            return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32))

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))

    from ejkernel_triton.gla.chunk import ChunkFwdParams

    want_out = jax.jit(lambda *a: xla_gdr(*a, use_qk_l2norm=True)[0])
    ref_out = want_out(*args).astype(jnp.float32)
    print(f"xla chunked fwd     {ms(want_out, *args):8.3f} ms", flush=True)
    for c, bv, w in ((0, 0, 0), (64, 32, 4), (64, 16, 4), (32, 64, 4), (64, 64, 8), (32, 32, 4), (32, 16, 4)):
        p = ChunkFwdParams() if c == 0 else ChunkFwdParams(chunk_size=c, block_v=bv, num_warps=w)
        f = jax.jit(lambda *a, p=p: chunk.gated_delta_rule(*a, use_qk_l2norm=True, fwd_params=p)[0])
        label = "default" if c == 0 else f"c{c} bv{bv} w{w}"
        try:  # at K = 256 value blocks of 64 exceed sm_90's shared memory: a clear error, then the next plan
            err = float(jnp.max(jnp.abs(f(*args).astype(jnp.float32) - ref_out)) / jnp.max(jnp.abs(ref_out)))
            print(f"triton_chunk fwd {label:12s} {ms(f, *args):8.3f} ms  rel err vs xla {err:.1e}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"triton_chunk fwd {label} ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
    if "--fwd-only" in sys.argv:
        return
    base = grad_of(xla_gdr)
    want = base(*args)
    print(f"xla chunked fwd+bwd {ms(base, *args):8.3f} ms", flush=True)
    # (chunk, block_v, warps, stages); stages 1: the reverse state pass without prefetching (its form before 2026-12-04)
    cands = [None] + [ChunkBwdParams(chunk_size=c, block_v=bv, num_warps=w, num_stages=st) for c, bv, w, st in
                      ((32, 32, 4, 1), (32, 32, 4, 3), (32, 16, 4, 2), (16, 32, 4, 2), (32, 32, 8, 2),
                       (32, 64, 4, 2), (32, 64, 8, 2), (64, 32, 8, 2), (64, 64, 8, 2))]  # fmt: skip
    for p in cands:
        f = grad_of(lambda *a, p=p, **kw: chunk.gated_delta_rule(*a, bwd_params=p, **kw))
        try:
            got = f(*args)
            errs = [float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))) /
                          max(float(jnp.max(jnp.abs(y.astype(jnp.float32)))), 1e-30)) for x, y in zip(got, want)]  # fmt: skip
            label = "default" if p is None else f"c{p.chunk_size} bv{p.block_v} w{p.num_warps} s{p.num_stages}"
            errs_s = " ".join(f"{n}={e:.1e}" for n, e in zip("q k v g beta".split(), errs))
            print(f"triton_chunk {label:16s} {ms(f, *args):8.3f} ms  rel err vs xla: {errs_s}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"triton_chunk {p} ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    main()
