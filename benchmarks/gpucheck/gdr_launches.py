"""The chunked ``gated_delta_rule`` forward's three launches timed one by one on a GPU (median of 15 calls each,
B4 T4096 H16 K=V=128; ``q``/``k`` float32 as the wrapper passes them, ``v`` bfloat16). Timings only: the outputs are
checked by the conformance suite's GPU tier, not here.

Run on the GPU machine after ``bash .ci/gpu setup``: ``PYTHONPATH=/tmp/ejk-site python3
benchmarks/gpucheck/gdr_launches.py``. The runs in ``benchmarks/results/2026-12-03-h200-gdr-chunk-launches.log``
used an earlier form of this script (a copy of the kernels at b8201be, before ``delta_prep`` took ``STORE_T``, and
an experimental blocked solve of ``T`` that was no faster and is not kept).
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.device import cdiv

from ejkernel_triton import _delta_chunk_kernels as kern
from ejkernel_triton import launch
from ejkernel_triton.gla.chunk import _chunk_table

B, T, H, DK, DV = 4, 4096, 16, 128, 128
R = B * T
F32 = jnp.float32


def _inputs() -> tuple[jax.Array, ...]:
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((R, H, DK)), F32)
    k = jnp.asarray(rng.standard_normal((R, H, DK)), F32)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jnp.asarray(rng.standard_normal((R, H, DV)), jnp.bfloat16)
    g = -jax.nn.softplus(-(jnp.asarray(rng.standard_normal((R, H)), F32) + 3))
    beta = jax.nn.sigmoid(jnp.asarray(rng.standard_normal((R, H)), F32))
    return q, k, v, g, beta


def _ms(f, *args) -> float:  # noqa: ANN001
    f = jax.jit(f)
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(15):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def run(bt: int, bv: int, warps: int, stages: int, prec: str) -> None:
    q, k, v, g, beta = _inputs()
    tab = _chunk_table(B, T, bt, None)
    common = {"H": H, "HV": H, "DK": DK, "DV": DV, "BT": bt, "BK": DK, "BV": bv, "PREC": prec}
    common |= {"num_warps": warps, "num_stages": stages}
    h0 = jnp.zeros((1,), F32)

    def prep(k, v, g, beta):  # noqa: ANN001, ANN202
        shapes = ((R, H, DK), (R, H, DV), (R, H), (1,))
        return launch.launch(
            kern.delta_prep, k, v, g, beta, tab.cu, tab.seq, tab.off,
            out_shape=tuple(jax.ShapeDtypeStruct(s, F32) for s in shapes),
            grid=(tab.nt, H), name="prep", STORE_T=False, **common,
        )[:3]  # fmt: skip

    def states(k, w, u, b):  # noqa: ANN001, ANN202
        shapes = ((R, H, DV), (tab.nt, H, DK, DV), (tab.n, H, DK, DV))
        return launch.launch(
            kern.delta_states, k, w, u, b, h0, tab.cu, tab.off,
            out_shape=tuple(jax.ShapeDtypeStruct(s, F32) for s in shapes),
            grid=(tab.n * cdiv(DV, bv), H), name="states", HAS_H0=False, **common,
        )  # fmt: skip

    def output(q, k, b, hs, uc):  # noqa: ANN001, ANN202
        return launch.launch(
            kern.delta_output, q, k, b, hs, uc, tab.cu, tab.seq, tab.off, 0.1,
            out_shape=(jax.ShapeDtypeStruct((R, H, DV), jnp.bfloat16),),
            grid=(tab.nt * cdiv(DV, bv), H), zeroed_outputs=(0,), name="output", **common,
        )  # fmt: skip

    w, u, b = jax.jit(prep)(k, v, g, beta)
    uc, hs, _ = jax.jit(states)(k, w, u, b)
    t1, t2, t3 = _ms(prep, k, v, g, beta), _ms(states, k, w, u, b), _ms(output, q, k, b, hs, uc)
    print(f"BT{bt} BV{bv} w{warps} s{stages} {prec}: prep {t1:.3f} states {t2:.3f} output {t3:.3f} "
          f"total {t1 + t2 + t3:.3f} ms", flush=True)  # fmt: skip


if __name__ == "__main__":
    for cfg in ((64, 64, 4, 2, "tf32x3"), (32, 64, 4, 2, "tf32x3"), (64, 64, 4, 2, "tf32"), (32, 64, 4, 2, "tf32"),
                (32, 32, 4, 2, "tf32"), (16, 64, 4, 2, "tf32")):  # fmt: skip
        try:
            run(*cfg)
        except Exception as e:  # a launch that does not fit (shared memory) is reported, the others still run
            print(cfg, "failed:", type(e).__name__, str(e)[:300], flush=True)
