"""GPU check (H200): the chunked Triton ``gla`` backward with its two state walks in one launch
(``chunk_state_pair``, ``Plan.paired_states``) against two launches (``chunk_state_fwd`` recomputing the float32
states, then ``chunk_state_bwd``), bf16, K=V=128, at B2 T16384 H16 and B4 T4096 H16 (``--shape B,T`` for one).

Why: each walk is a chain of dependent chunk steps, one program per state tile (128 programs of 64 x 64 tiles at
B2 H16, about one per SM), so the two launches take the sum of two chains (0.593 + 0.596 ms at B2 T16384 on
2026-12-06, ``benchmarks/results/2026-12-06-h200-gla-state-sweep.log``); paired, two programs share each SM (171
registers and 90624 bytes of shared memory a program at 4 warps, 3 stages: ptxas for sm_90) and the chains run
side by side. For each shape: the walks alone (own timer, ``_timing.median_ms``; states and gradients compared, max
abs difference over max abs), then the whole forward + backward of ``gla`` both ways (gradients compared), and of
``simple_gla`` (the scalar decay of ``lightning_attn`` and ``recurrent``: ``simple_state_pair``); then packed
sequences with an initial state, both ops, gradients compared. Outputs must agree exactly: the pair runs the same
code per program, so a difference is a miscompile (the two-launch path is the one the conformance suite checks).

    bash .ci/gpu setup >/dev/null && PYTHONPATH=/tmp/ejk-site python3 benchmarks/gpucheck/gla_state_pair.py

First (``check_decayed``): gla's forward with its state walk reading the decayed keys (``Plan.decayed_keys``)
against the walk decaying them, outputs exact, both timed, then packed with an initial state.

``--small``: tiny shapes (a dry run on a CPU with EJKERNEL_TRITON_INTERPRET=1).
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
from _timing import median_ms  # benchmarks/gpucheck/_timing.py (the script's folder is on sys.path)

from ejkernel_triton import _simple_chunk as simple
from ejkernel_triton.gla import chunk

SMALL = "--small" in sys.argv
H, K = (2, 32) if SMALL else (16, 128)
SHAPES = [(1, 80)] if SMALL else [(2, 16384), (4, 4096)]
if "--shape" in sys.argv:
    SHAPES = [tuple(int(x) for x in sys.argv[sys.argv.index("--shape") + 1].split(","))]
N_TIMED, REPS = (3, 1) if SMALL else (15, 5)


def _diff(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def check(b: int, t: int) -> None:
    """gla's two walks alone, then its forward + backward, timed."""
    plan_of = chunk.default_plan
    rng = np.random.default_rng(0)
    bf = jnp.bfloat16
    r = b * t
    q, k, v, do = (jnp.asarray(rng.standard_normal((r, H, K)), bf) for _ in range(4))
    g = jnp.asarray(-np.logaddexp(0.0, -rng.standard_normal((r, H, K))) / 16, jnp.float32)
    dht = jnp.asarray(rng.standard_normal((b, H, K, K)), jnp.float32)
    tab = chunk._chunk_table(b, t, 16 if SMALL else 64, None)
    base = plan_of(chunk.Dims(K, K, b * H), "bwd")
    if SMALL:
        base = dataclasses.replace(base, chunk=16)
    s = chunk.Static(base, base, K**-0.5, True)
    gc = chunk._gate_cumsum(base, tab, g, H)
    print(
        f"B{b} T{t} H{H} K=V={K} bf16: state tile {base.state_k}x{base.state_v}, {base.state_warps} warps, "
        f"{base.state_stages} stages",
        flush=True,
    )

    def two(q, k, v, do, gc, dht):
        hs, _ = chunk._states(base, tab, k, v, gc, None, jnp.float32, True)
        return (hs, *chunk._dstates(base, tab, q, do, gc, dht, s.scale, H))

    def one(q, k, v, do, gc, dht):
        return chunk._state_pair(base, tab, q, k, v, do, gc, None, dht, s.scale)

    walks = [jax.jit(f) for f in (two, one)]
    args = (q, k, v, do, gc, dht)
    ref = walks[0](*args)
    diff = max(_diff(x, y) for x, y in zip(walks[1](*args), ref, strict=True))
    times = [median_ms(f, *args, n=N_TIMED, reps=REPS) for f in walks]
    print(f"  walks: two launches {times[0]:.3f} ms, paired {times[1]:.3f} ms (max rel diff {diff:.1e})", flush=True)

    x = tuple(a.reshape(b, t, H, K) for a in (q, k, v)) + (g.reshape(b, t, H, K),)
    compare("gla", chunk, chunk.gla, x, do.reshape(b, t, H, K))


def _traced(module, fn, x, paired_states: bool = False, decayed_keys: bool = False):  # noqa: ANN001, ANN202
    """``jax.jit(fn)``, traced on ``x`` while ``module.default_plan`` pairs the backward's walks (``paired_states``)
    and walks the forward's decayed keys (``decayed_keys``, gla only)."""
    plan_of = module.default_plan

    def default_plan(d, stage="fwd"):  # noqa: ANN001, ANN202
        plan = dataclasses.replace(plan_of(d, stage), paired_states=paired_states and stage == "bwd")
        return dataclasses.replace(plan, decayed_keys=True) if decayed_keys and stage == "fwd" else plan

    module.default_plan = default_plan
    try:
        f = jax.jit(fn)
        f(*x)  # traced with this plan
    finally:
        module.default_plan = plan_of
    return f


def compare(name: str, module, fn, x, cot, timed: bool = True, **kw) -> None:  # noqa: ANN001
    """``fn(*x, **kw)``'s forward + backward with the backward's state walks in two launches and paired
    (``module.default_plan`` patched while tracing): gradients compared, both timed when ``timed``."""

    def grads(paired: bool):
        return _traced(module, lambda *a: jax.vjp(lambda *y: fn(*y, **kw)[0], *a)[1](cot), x, paired_states=paired)

    fns = [grads(False), grads(True)]
    outs = [f(*x) for f in fns]
    diff = max(_diff(a, c) for a, c in zip(outs[1], outs[0], strict=True))
    line = f"  {name} forward + backward: gradients' max rel diff paired against two launches {diff:.1e}"
    if timed:
        times = [median_ms(f, *x, n=N_TIMED, reps=REPS) for f in fns]
        line += f"; two launches {times[0]:.3f} ms, paired {times[1]:.3f} ms"
    print(line, flush=True)


def check_decayed(b: int, t: int, **kw) -> None:  # noqa: ANN003
    """gla's forward (no final state) with its state walk reading the decayed keys (``Plan.decayed_keys``) against
    the walk decaying them itself: outputs must agree exactly (same products of the same rounded operands); timed
    unless packed (``kw``)."""
    rng = np.random.default_rng(2)
    x = tuple(jnp.asarray(rng.standard_normal((b, t, H, K)), jnp.bfloat16) for _ in range(3))
    x += (jnp.asarray(-np.logaddexp(0.0, -rng.standard_normal((b, t, H, K))) / 16, jnp.float32),)

    def forward(decayed: bool):
        return _traced(chunk, lambda *a: chunk.gla(*a, **kw)[0], x, decayed_keys=decayed)

    fns = [forward(False), forward(True)]
    outs = [f(*x) for f in fns]
    rows = slice(None) if "cu_seqlens" not in kw else slice(0, int(kw["cu_seqlens"][-1]))
    diff = _diff(outs[1][:, rows], outs[0][:, rows])
    line = f"  gla forward{' (packed)' if kw else ''}: decayed keys' max rel diff {diff:.1e}"
    if not kw:
        times = [median_ms(f, *x, n=N_TIMED, reps=REPS) for f in fns]
        line += f"; walk decaying {times[0]:.3f} ms, decayed keys {times[1]:.3f} ms"
    print(line, flush=True)


def check_simple(b: int, t: int) -> None:
    """``simple_gla`` (the scalar decay: ``simple_state_pair``), timed."""
    rng = np.random.default_rng(0)
    x = tuple(jnp.asarray(rng.standard_normal((b, t, H, K)), jnp.bfloat16) for _ in range(3))
    x += (jnp.asarray(-np.logaddexp(0.0, -rng.standard_normal((b, t, H))) / 16, jnp.float32),)
    compare("simple_gla", simple, simple.simple_gla, x, jnp.asarray(rng.standard_normal((b, t, H, K)), jnp.bfloat16))


def check_packed() -> None:
    """Packed sequences (an empty one, ends mid-chunk, tokens after the last) with an initial state: both ops'
    gradients, paired against two launches (not timed)."""
    rng = np.random.default_rng(1)
    t = 400 if SMALL else 9000
    cu = jnp.asarray([0, 1, t // 3, t // 3, t - 77], jnp.int32)
    q, k, v = (jnp.asarray(rng.standard_normal((1, t, H, K)), jnp.bfloat16) for _ in range(3))
    h0 = jnp.asarray(rng.standard_normal((4, H, K, K)), jnp.float32)
    cot = jnp.asarray(rng.standard_normal((1, t, H, K)), jnp.bfloat16)
    gk = jnp.asarray(-np.logaddexp(0.0, -rng.standard_normal((1, t, H, K))) / 16, jnp.float32)
    kw = {"cu_seqlens": cu, "initial_state": h0, "output_final_state": True}
    compare("gla (packed)", chunk, chunk.gla, (q, k, v, gk), cot, timed=False, **kw)
    compare("simple_gla (packed)", simple, simple.simple_gla, (q, k, v, gk[..., 0]), cot, timed=False, **kw)


def main() -> None:
    for b, t in SHAPES:
        check_decayed(b, t)
    t = 400 if SMALL else 9000
    h0 = jnp.asarray(np.random.default_rng(3).standard_normal((4, H, K, K)), jnp.float32)
    check_decayed(1, t, cu_seqlens=jnp.asarray([0, 1, t // 3, t // 3, t - 77], jnp.int32), initial_state=h0)
    for b, t in SHAPES:
        check(b, t)
        check_simple(b, t)
    check_packed()


if __name__ == "__main__":
    main()
