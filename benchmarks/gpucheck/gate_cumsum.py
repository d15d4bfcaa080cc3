"""gla's chunked gate cumsum (``ejkernel_triton._chunk_kernels.chunk_gate_cumsum``) launched alone at every key tile
(16 to 128 channels) and warp count (1 to 8), against XLA's cumsum of the same chunks and an empty jitted call (the
floor of this wall-clock timer: dispatch and synchronisation), B4 T4096 H16 K128 bf16 gates, chunks of 64. Every
launch is checked against XLA's result first (max abs error). Written to see whether the 0.18 ms that
``gla_chunk.py --kernels`` gave this launch was real (2026-12-04: the empty call alone takes 0.15 ms).

Run on the GPU machine after ``bash .ci/gpu setup``: ``PYTHONPATH=/tmp/ejk-site python3
benchmarks/gpucheck/gate_cumsum.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from _timing import median_ms  # benchmarks/gpucheck/_timing.py (the script's folder is on sys.path)

from ejkernel_triton import _chunk_kernels as kern
from ejkernel_triton import launch
from ejkernel_triton.gla.chunk import _chunk_table

B, T, H, K, C = 4, 4096, 16, 128, 64


def bench(fn, *args):
    return median_ms(fn, *args, n=30)


def main():
    g = jax.nn.log_sigmoid(jax.random.normal(jax.random.key(0), (B * T, H, K), jnp.float32)).astype(jnp.bfloat16)
    tab = _chunk_table(B, T, C, None)

    def triton_cumsum(bk, warps):
        def f(g):
            return launch.launch(
                kern.chunk_gate_cumsum, g, tab.cu, tab.seq, tab.off,
                out_shape=(jax.ShapeDtypeStruct(g.shape, jnp.float32),), grid=(tab.nt, H, -(-K // bk)),
                num_warps=warps, num_stages=1, HV=H, GK=K, BT=C, BK=bk,
            )[0]  # fmt: skip

        return jax.jit(f)

    ref = jax.jit(lambda g: jnp.cumsum(g.astype(jnp.float32).reshape(B * T // C, C, H, K), axis=1).reshape(g.shape))
    want = ref(g)
    print(f"xla cumsum {bench(ref, g):.3f} ms  (bytes {g.size * 6 / 1e6:.0f} MB)")
    print(f"empty jit  {bench(jax.jit(lambda g: g[:1]), g):.3f} ms")
    for bk in (16, 32, 64, 128):
        for warps in (1, 2, 4, 8):
            f = triton_cumsum(bk, warps)
            err = float(jnp.max(jnp.abs(f(g) - want)))
            print(f"triton bk{bk:3d} w{warps}  {bench(f, g):.3f} ms  max err {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
