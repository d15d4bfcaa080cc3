"""GPU check (H200): the chunked Triton ``gated_delta_rule`` forward (``use_qk_l2norm``, bf16, K=V=128; B2 T16384
H16, ``--shape B,T`` for another) at forward plans of value blocks 32/64, warps 2/4/8 and stages 1-4 (chunks of 64),
each config's output against XLA's chunked one, for Nsight Compute: each of the three launches (``delta_prep``,
``delta_states``, ``delta_output``) gets its own time, so one sweep says which plan suits which launch (warps and
stages are shared by the three today, and at few states the state pass takes value blocks of 32 whatever the
plan's; at B2 T16384 our states pass took 486 us against fla's 305,
``benchmarks/results/2026-12-05-h200-gdr-B2T16384-ncu.log``).

    bash .ci/gpu setup >/dev/null && PYTHONPATH=/tmp/ejk-site ncu --clock-control none \
        --metrics gpu__time_duration.sum,launch__registers_per_thread -k regex:delta_ --csv \
        python3 benchmarks/gpucheck/gdr_fwd_sweep.py > log && python3 benchmarks/gpucheck/ncu_summary.py log --per 6

Each config runs twice (the first compiles): six launches per config, in the order of the printed ``config``
lines; a config that does not compile (shared memory) prints ``skipped`` and no ``config`` line. ``--bv 64``,
``--warps 2,4``, ``--stages 2,3``: those values alone. ``--state``: the configs go to the state pass alone
(``Plan.state_v``, ``state_warps``, ``state_stages``; the other two launches keep the default plan). Each config
also prints the whole forward's time by its own timer (``_timing.median_ms``, 5 calls a sample): a ranking without
Nsight Compute (which crashed at start with ``--clock-control none`` on the machine of 2026-12-05's third session).
``--small``: tiny shapes and two configs (a dry run on a CPU with EJKERNEL_TRITON_INTERPRET=1).
"""

from __future__ import annotations

import dataclasses
import itertools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from _timing import median_ms  # benchmarks/gpucheck/_timing.py (the script's folder is on sys.path)

from ejkernel_triton.gated_delta_rule import chunk
from ejkernel_triton.gla.chunk import ChunkFwdParams
from ejkernel_xla.gated_delta_rule.interface import gated_delta_rule as xla_gdr

SMALL = "--small" in sys.argv
STATE = "--state" in sys.argv
B, T, H, K = (1, 48, 2, 32) if SMALL else (2, 16384, 16, 128)
if "--shape" in sys.argv:
    B, T = (int(x) for x in sys.argv[sys.argv.index("--shape") + 1].split(","))


def _values(flag: str, default: tuple[int, ...]) -> tuple[int, ...]:
    """The values after ``flag`` (``--bv 32,64``), else ``default``."""
    return tuple(int(x) for x in sys.argv[sys.argv.index(flag) + 1].split(",")) if flag in sys.argv else default


AXES = (_values("--bv", (32, 64)), _values("--warps", (2, 4, 8)), _values("--stages", (1, 2, 3, 4)))
CONFIGS = [(32, 4, 2), (16, 4, 1)] if SMALL else list(itertools.product(*AXES))


def main() -> None:
    rng = np.random.default_rng(0)
    bf = jnp.bfloat16
    q, k, v = (jnp.asarray(rng.standard_normal((B, T, H, K)), bf) for _ in range(3))
    g = jnp.asarray(-jax.nn.softplus(-(rng.standard_normal((B, T, H)) + 3)), jnp.float32)
    beta = jnp.asarray(jax.nn.sigmoid(rng.standard_normal((B, T, H))), jnp.float32)
    args = (q, k, v, g, beta)
    want = jax.jit(lambda *a: xla_gdr(*a, use_qk_l2norm=True)[0])(*args).astype(jnp.float32)
    scale = float(jnp.max(jnp.abs(want)))
    chunk_size = 16 if SMALL else 64
    base = chunk._plan(K, K, ChunkFwdParams(chunk_size=chunk_size), bf, B * H)
    for bv, warps, stages in CONFIGS:
        if STATE:  # the state pass alone takes the config (its value block, warps, stages); the others the default
            plan = dataclasses.replace(base, state_v=bv, state_warps=warps, state_stages=stages)
            label = f"state bv {bv} warps {warps} stages {stages}"
        else:
            plan = chunk._plan(K, K, ChunkFwdParams(chunk_size, None, bv, warps, stages), bf, B * H)
            label = f"bv {bv} warps {warps} stages {stages}"
        s = chunk.Static(plan, plan, K**-0.5, False, True)
        f = jax.jit(lambda *a, s=s: chunk.chunk_delta(s, *a, None, None)[0])
        try:
            for _ in range(2):
                out = jax.block_until_ready(f(*args))
        except Exception as e:  # noqa: BLE001 - a plan past the shared memory: say so, go on
            print(f"skipped {label}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - want))) / scale
        ms = median_ms(f, *args, n=5 if SMALL else 15, reps=1 if SMALL else 5)
        print(f"config {label}: rel err vs xla {err:.1e}, {ms:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
