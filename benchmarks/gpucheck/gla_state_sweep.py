"""GPU check (H200): the chunked Triton ``gla``'s state passes timed alone (wall clock, ``_timing.median_ms``) at
state tiles ``[state_k, state_v]`` of 32/64/128 x 32/64 channels, warps 2/4/8 and stages 1-3 (chunks of 64; bf16,
B2 T16384 H16 K=V=128, ``--shape B,T`` for another): the forward's ``chunk_state_fwd`` (states stored in bf16,
plain products), the backward's recompute of it (float32 states, split products) and ``chunk_state_bwd``. Each
config's states are compared with the heuristic plan's (max abs difference over max abs): a tile or launch that
changes the result is caught here before its time counts. At B2 T16384 gla's forward+backward was 16% behind fla's
(``benchmarks/results/2026-12-05-h200-gla-B2T16384.json``) while level at B4 T4096: the passes that walk the
sequence are the suspects.

    bash .ci/gpu setup >/dev/null && PYTHONPATH=/tmp/ejk-site python3 benchmarks/gpucheck/gla_state_sweep.py

``--warps 2,4``, ``--stages 2``, ``--tiles 64x64,32x32``: those values alone. ``--small``: tiny shapes and two
configs (a dry run on a CPU with EJKERNEL_TRITON_INTERPRET=1).
"""

from __future__ import annotations

import dataclasses
import itertools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from _timing import median_ms

from ejkernel_triton.gla import chunk

SMALL = "--small" in sys.argv
B, T, H, K = (1, 80, 2, 32) if SMALL else (2, 16384, 16, 128)
if "--shape" in sys.argv:
    B, T = (int(x) for x in sys.argv[sys.argv.index("--shape") + 1].split(","))


def _values(flag: str, default: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(sys.argv[sys.argv.index(flag) + 1].split(",")) if flag in sys.argv else default


TILES = [
    tuple(int(x) for x in t.split("x")) for t in _values("--tiles", ("128x64", "64x64", "64x32", "32x64", "32x32"))
]
WARPS = [int(x) for x in _values("--warps", ("2", "4", "8"))]
STAGES = [int(x) for x in _values("--stages", ("1", "2", "3"))]
CONFIGS = [((16, 16), 4, 2), ((32, 32), 2, 1)] if SMALL else list(itertools.product(TILES, WARPS, STAGES))


def main() -> None:
    rng = np.random.default_rng(0)
    bf = jnp.bfloat16
    r = B * T
    q, k, v, do = (jnp.asarray(rng.standard_normal((r, H, K)), bf) for _ in range(4))
    g = jnp.asarray(-np.logaddexp(0.0, -rng.standard_normal((r, H, K))) / 16, jnp.float32)
    tab = chunk._chunk_table(B, T, 64 if not SMALL else 16, None)
    d = chunk.Dims(K, K, B * H)
    base = chunk.default_plan(d, "bwd")
    if SMALL:
        base = dataclasses.replace(base, chunk=16)
    s = chunk.Static(base, base, K**-0.5, False)
    gc, *_ = chunk._prologue(s, base, tab, q, k, v, g, None)
    print(
        f"B{B} T{T} H{H} K=V={K} bf16; heuristic state tile {base.state_k}x{base.state_v}, warps {base.state_warps}"
        f", stages {base.state_stages}",
        flush=True,
    )

    def passes(plan: chunk.Plan):
        fwd = jax.jit(lambda k, v, gc: chunk._states(plan, tab, k, v, gc, None, bf, False)[0])
        rec = jax.jit(lambda k, v, gc: chunk._states(plan, tab, k, v, gc, None, jnp.float32, True)[0])
        bwd = jax.jit(lambda q, do, gc: chunk._dstates(plan, tab, q, do, gc, None, s.scale, H)[0])
        return (fwd, (k, v, gc)), (rec, (k, v, gc)), (bwd, (q, do, gc))

    refs = [np.asarray(f(*a).astype(jnp.float32)) for f, a in passes(base)]
    for (sk, sv), warps, stages in CONFIGS:
        plan = dataclasses.replace(base, state_k=min(sk, K), state_v=min(sv, K), state_warps=warps, state_stages=stages)
        times, errs = [], []
        try:
            for (f, a), ref in zip(passes(plan), refs, strict=True):
                out = np.asarray(f(*a).astype(jnp.float32))
                errs.append(float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30)))
                times.append(median_ms(f, *a, n=5 if SMALL else 15, reps=1 if SMALL else 5))
        except Exception as e:  # noqa: BLE001 (shared memory or registers: the config does not compile)
            print(f"tile {sk}x{sv} warps {warps} stages {stages}: skipped ({type(e).__name__})", flush=True)
            continue
        print(
            f"tile {sk}x{sv} warps {warps} stages {stages}: fwd {times[0]:.3f} recompute {times[1]:.3f} "
            f"bwd {times[2]:.3f} ms (max rel diff {max(errs):.1e})",
            flush=True,
        )


if __name__ == "__main__":
    main()
