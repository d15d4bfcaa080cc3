"""GPU check (H200): forward time of the chunked Triton ``gla`` (B4 T4096 H16 K=V=128 bf16) at chunk_intra_diag's
warps 1/2/4/8 and chunk_intra_offdiag's 1/2/4, each output against the first's (all forms must agree to rounding).

    bash .ci/gpu setup >/dev/null && PYTHONPATH=/tmp/ejk-site python3 benchmarks/gpucheck/gla_intra_warps.py
"""

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.modules import gla

from ejkernel_triton.gla import chunk

rng = np.random.default_rng(0)
B, T, H, K = 4, 4096, 16, 128
bf = jnp.bfloat16
q, k, v = (jnp.asarray(rng.standard_normal((B, T, H, K)), bf) for _ in range(3))
g = jnp.asarray(-np.logaddexp(0.0, -rng.standard_normal((B, T, H, K))).astype(np.float32) / 16)


def bench(fn, n=30):
    jax.block_until_ready(fn(q, k, v, g))
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(fn(q, k, v, g))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


ref = None
blk = chunk._block_launch
for dw in (1, 2, 4, 8):
    for ow in (1, 2, 4):
        chunk._DIAG_WARPS = dw
        chunk._block_launch = lambda plan, dot, kernel, ow=ow: {
            **blk(plan, dot, kernel),
            **({"num_warps": ow} if kernel == "attn" else {}),
        }
        fn = jax.jit(lambda q, k, v, g: gla(q, k, v, g, platform="triton_chunk")[0])
        o = fn(q, k, v, g)
        if ref is None:
            ref = o
        err = float(jnp.max(jnp.abs(o.astype(jnp.float32) - ref.astype(jnp.float32))))
        print(f"diag warps {dw} offdiag warps {ow}: fwd {bench(fn):.3f} ms  max diff vs first {err:.2e}", flush=True)
