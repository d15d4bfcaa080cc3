"""How repeatable the autotuner's timer is on a decode-sized kernel (~20 µs on an H200), run after run.

Each of ``--runs`` runs is a fresh process (``--same-process``: one process) that times, with the
autotuner's own settings (``Autotuner().measure``): a decode GEMV (``[8, 4096] @ [4096, 14336]`` bf16, the
weights read once: ~27 µs at 4.3 TB/s), XLA's dense decode attention (``jax.nn.dot_product_attention``:
8 sequences, one query each over 2048 keys, 32 query heads over 8 KV heads of 128; ~16 µs of KV reads) and
ejkernel-xla's ``page_attention`` at the same size (pages of 16). For contrast each run also times the old way, a host
clock around single calls (one warm-up, the median of five). Prints the per-run medians and their spread
((max - min) / median of the runs' medians) and writes them as JSON to ``--out``.

    python ejkernel-triton/benchmarks/timer_repeatability.py --out bench-results/timer_repeatability.json

(Without ejkernel installed: ``PYTHONPATH=ejkernel-core/src:ejkernel-xla/src`` from the repository root.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def gemv() -> tuple[Callable[..., Any], tuple[Any, ...]]:
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (8, 4096), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (4096, 14336), jnp.float32).astype(jnp.bfloat16)
    return (lambda x, w: x @ w), (x, w)


def decode_attention() -> tuple[Callable[..., Any], tuple[Any, ...]]:
    n, h, kh, d, tokens = 8, 32, 8, 128, 2048
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (n, 1, h, d), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(kk, (n, tokens, kh, d), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(kv, (n, tokens, kh, d), jnp.float32).astype(jnp.bfloat16)
    return (lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla")), (q, k, v)


def page_attention() -> tuple[Callable[..., Any], tuple[Any, ...]]:
    from ejkernel_xla.page_attention import page_attention as pa

    n, h, kh, d, page, tokens = 8, 32, 8, 128, 16, 2048
    pages = n * tokens // page
    kq, kk, kv, kp = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (n, h, d), jnp.float32).astype(jnp.bfloat16)
    kc = jax.random.normal(kk, (pages, page, kh, d), jnp.float32).astype(jnp.bfloat16)
    vc = jax.random.normal(kv, (pages, page, kh, d), jnp.float32).astype(jnp.bfloat16)
    tables = jax.random.permutation(kp, pages).reshape(n, tokens // page).astype(jnp.int32)
    lens = jnp.full((n,), tokens, jnp.int32)
    return pa, (q, kc, vc, lens, tables)


KERNELS = {"gemv": gemv, "decode_attention": decode_attention, "page_attention": page_attention}


def wall_clock(fn: Callable[..., Any], args: tuple[Any, ...]) -> float:
    """The old autotuner's timer: one warm-up call, then the median of five, a host clock around each."""
    f = jax.jit(fn)
    jax.block_until_ready(f(*args))
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready(f(*args))
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def one_run(names: list[str]) -> dict[str, Any]:
    from ejkernel.ops.config.autotune import Autotuner

    tuner = Autotuner()
    out: dict[str, Any] = {}
    for name in names:
        try:
            fn, args = KERNELS[name]()
            started = time.perf_counter()
            m = tuner.measure(fn, args)
            out[name] = {**m.to_dict(), "wall_s": time.perf_counter() - started, "old_timer_s": wall_clock(fn, args)}
        except Exception as e:  # noqa: BLE001 - a kernel that cannot run here is reported, not fatal
            out[name] = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"}
    return out


def spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--kernels", default=",".join(KERNELS))
    parser.add_argument("--out", default="bench-results/timer_repeatability.json")
    parser.add_argument("--same-process", action="store_true", help="all runs in this process")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = parser.parse_args()
    names = a.kernels.split(",")
    if a.child:
        print(json.dumps(one_run(names)))
        return

    runs = []
    for i in range(a.runs):
        if a.same_process:
            runs.append(one_run(names))
        else:
            cmd = [sys.executable, __file__, "--child", "--kernels", a.kernels]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                sys.exit(f"run {i} failed:\n{proc.stderr[-3000:]}")
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"run {i + 1}/{a.runs}: {json.dumps(runs[-1])[:300]}", file=sys.stderr, flush=True)

    summary: dict[str, Any] = {}
    print(f"\n{'kernel':16} {'medians over runs (µs)':48} {'spread':>7} {'old timer (µs)':36} {'spread':>7}")
    for name in names:
        ok = [r[name] for r in runs if "seconds" in r.get(name, {})]
        if not ok:
            errors = {r.get(name, {}).get("error") for r in runs}
            summary[name] = {"error": sorted(e for e in errors if e)}
            print(f"{name:16} failed: {summary[name]['error']}")
            continue
        med = [r["seconds"] for r in ok]
        old = [r["old_timer_s"] for r in ok]
        summary[name] = {
            "medians_s": med,
            "spread": spread(med),
            "within_iqr": [r["spread"] for r in ok],
            "calls": [r["calls"] for r in ok],
            "method": sorted({r["method"] for r in ok}),
            "old_timer_s": old,
            "old_timer_spread": spread(old),
        }
        print(
            f"{name:16} {' '.join(f'{s * 1e6:8.2f}' for s in med):48} {spread(med):7.1%} "
            f"{' '.join(f'{s * 1e6:6.1f}' for s in old):36} {spread(old):7.1%}"
        )
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "runs": a.runs,
        "separate_processes": not a.same_process,
        "command": " ".join(sys.argv),
    }
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "summary": summary, "runs": runs}, f, indent=1)
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
