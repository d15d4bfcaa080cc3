"""GPU check (H200): the chunked Triton ``gla`` forward (B4 T4096 H16 K=V=128 bf16) at chunk_intra_diag's warps
1/2/4/8 and chunk_intra_offdiag's 1/2/4, each config's output against the first's (all must agree to rounding), for
Nsight Compute: wall-clock medians here could not rank them (2026-12-05: 1.1-1.9 ms with no order), the kernels'
own times do.

    bash .ci/gpu setup >/dev/null && PYTHONPATH=/tmp/ejk-site ncu --clock-control none \
        --metrics gpu__time_duration.sum,launch__registers_per_thread -k regex:chunk_intra --csv \
        python3 benchmarks/gpucheck/gla_intra_warps.py > log && python3 benchmarks/gpucheck/ncu_summary.py log --per 4

Each config runs twice (the first compiles): four launches per config (diag, offdiag, diag, offdiag) in the order
of the printed ``config`` lines.
"""

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
        for _ in range(2):
            o = jax.block_until_ready(fn(q, k, v, g))
        if ref is None:
            ref = o
        err = float(jnp.max(jnp.abs(o.astype(jnp.float32) - ref.astype(jnp.float32))))
        print(f"config diag warps {dw} offdiag warps {ow}: max diff vs first {err:.2e}", flush=True)
