"""CPU benchmark of the XLA blockwise ``flash_attention`` against XLA's dense attention.

    python ejkernel-xla/benchmarks/flash_attention_cpu.py [--out bench-results/flash_attention_cpu.json]

1. Forward time, B=1, H=8, D=64, float32, causal and not, at T=S in ``--lengths``: the blockwise
   implementation vs ``jax.nn.dot_product_attention(implementation="xla")`` (the core's timer,
   ``ejkernel.ops.timing``: the median of ``--repeats`` samples after a warm-up; the two outputs are checked
   against each other).
2. Forward+backward memory vs T (``--mem-lengths``) from the compiled programs' ``memory_analysis()``
   (arguments + outputs + temporaries), for both implementations (compiled only, never run).
3. Forward+backward actually run at ``--run-lengths``, causal and not, each in a fresh process whose
   peak resident memory (VmHWM: everything, JAX runtime and inputs included) is reported too.

Prints a table and writes everything as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.ops.timing import measure
from ejkernel.ops.utils.datacarrier import BwdParams, FwdParams

from ejkernel_xla.flash_attention import flash_attention

B, H, D = 1, 8, 64
GIB = 2**30


def ours(causal: bool, blocks: tuple[int, int] | None, bwd_blocks: tuple[int, int] | None = None) -> Any:
    fp = FwdParams(*blocks) if blocks else None
    bp = BwdParams(*bwd_blocks) if bwd_blocks else None
    return lambda q, k, v: flash_attention(q, k, v, causal=causal, fwd_params=fp, bwd_params=bp)


def dense(causal: bool) -> Any:
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")


def inputs(t: int) -> tuple[jax.Array, ...]:
    keys = jax.random.split(jax.random.key(0), 3)
    return tuple(jax.random.normal(k, (B, t, H, D), jnp.float32) for k in keys)


def timeit(fn: Any, args: tuple[Any, ...], repeats: int) -> tuple[float, Any]:
    out = jax.block_until_ready(fn(*args))  # compile + warm-up
    return measure(fn, *args, samples=repeats, min_samples=repeats).seconds, out


def fwd_bwd(fn: Any) -> Any:
    return jax.jit(jax.value_and_grad(lambda q, k, v: fn(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))


def compiled_memory(fn: Any, t: int) -> dict[str, int]:
    x = jax.ShapeDtypeStruct((B, t, H, D), jnp.float32)
    m = fwd_bwd(fn).lower(x, x, x).compile().memory_analysis()
    out = {
        "argument_bytes": int(m.argument_size_in_bytes),
        "output_bytes": int(m.output_size_in_bytes),
        "temp_bytes": int(m.temp_size_in_bytes),
    }
    out["total_bytes"] = sum(out.values())
    return out


def run_fwd_bwd(t: int, causal: bool) -> dict[str, float]:
    """Child-process body: one forward+backward at T=S=t; its time and the process's peak RSS."""
    args = inputs(t)
    f = fwd_bwd(ours(causal, None))
    t0 = time.perf_counter()
    c = f.lower(*args).compile()
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(2 if t <= 8192 else 1):  # the first run pays for page faults and thread start-up
        t0 = time.perf_counter()
        jax.block_until_ready(c(*args))
        times.append(time.perf_counter() - t0)
    run_s = min(times)
    return {"compile_s": compile_s, "run_s": run_s, "peak_rss_bytes": _peak_rss()}


def _peak_rss() -> int:
    """This process's peak resident memory: VmHWM (Linux; unlike ru_maxrss it does not inherit the parent's)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench-results/flash_attention_cpu.json")
    ap.add_argument("--lengths", type=int, nargs="*", default=[2048, 8192])
    ap.add_argument("--mem-lengths", type=int, nargs="*", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--run-lengths", type=int, nargs="*", default=[8192, 32768], help="fwd+bwd actually run")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--blocks", type=str, default=None, help="forward q x kv block sizes, e.g. 256x512 (default: heuristic)"
    )
    ap.add_argument("--child", type=str, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()

    if a.child:  # internal: one forward+backward in this fresh process
        t, causal = a.child.split(":")
        print(json.dumps(run_fwd_bwd(int(t), causal == "1")))
        return

    blocks = tuple(int(x) for x in a.blocks.split("x")) if a.blocks else None
    result: dict[str, Any] = {
        "config": {"B": B, "H": H, "D": D, "dtype": "float32", "jax": jax.__version__, "cpu": platform.processor() or platform.machine(),
                   "cores": os.cpu_count(), "blocks": a.blocks or "heuristic", "repeats": a.repeats},
        "forward": [], "memory": [], "fwd_bwd_run": [],
    }  # fmt: skip

    print(f"forward, B={B} H={H} D={D} float32, median of {a.repeats} runs (seconds)")
    print(f"{'T':>6} {'causal':>6} {'blockwise':>10} {'xla dense':>10} {'ratio':>6} {'max|diff|':>9}")
    for t in a.lengths:
        args = inputs(t)
        repeats = a.repeats if t <= 4096 else max(3, a.repeats // 2)
        for causal in (False, True):
            t_ours, o1 = timeit(jax.jit(ours(causal, blocks)), args, repeats)
            t_dense, o2 = timeit(jax.jit(dense(causal)), args, repeats)
            diff = float(jnp.max(jnp.abs(o1 - o2)))
            assert diff < 1e-4, f"outputs differ by {diff} at T={t}, causal={causal}"
            del o1, o2
            row = {"T": t, "causal": causal, "blockwise_s": t_ours, "xla_dense_s": t_dense,
                   "ratio": t_ours / t_dense, "max_abs_diff": diff}  # fmt: skip
            result["forward"].append(row)
            print(
                f"{t:>6} {causal!s:>6} {t_ours:>10.4f} {t_dense:>10.4f} {t_ours / t_dense:>6.2f} {diff:>9.1e}",
                flush=True,
            )

    print("\nforward+backward memory, compiled memory_analysis() (arguments + outputs + temporaries, GiB)")
    print(f"{'T':>6} {'blockwise':>10} {'(temp)':>8} {'xla dense':>10} {'(temp)':>8} {'TxS f32':>8}")
    for t in a.mem_lengths:
        m1 = compiled_memory(ours(True, blocks), t)
        m2 = compiled_memory(dense(True), t)
        score = B * H * t * t * 4
        result["memory"].append({"T": t, "blockwise": m1, "xla_dense": m2, "dense_scores_bytes": score})
        print(f"{t:>6} {m1['total_bytes'] / GIB:>10.3f} {m1['temp_bytes'] / GIB:>8.3f} "
              f"{m2['total_bytes'] / GIB:>10.2f} {m2['temp_bytes'] / GIB:>8.2f} {score / GIB:>8.2f}", flush=True)  # fmt: skip

    print("\nforward+backward run (heuristic blocks), each in a fresh process")
    print(f"{'T':>6} {'causal':>6} {'compile s':>9} {'run s':>8} {'peak RSS GiB':>12}")
    for t in a.run_lengths:
        for causal in (True, False):
            cmd = [sys.executable, __file__, "--child", f"{t}:{int(causal)}"]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                print(f"{t:>6} {causal!s:>6} failed: {proc.stderr.strip().splitlines()[-1:]}")
                result["fwd_bwd_run"].append({"T": t, "causal": causal, "error": proc.stderr[-2000:]})
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            result["fwd_bwd_run"].append({"T": t, "causal": causal, **r})
            print(
                f"{t:>6} {causal!s:>6} {r['compile_s']:>9.1f} {r['run_s']:>8.1f} {r['peak_rss_bytes'] / GIB:>12.2f}",
                flush=True,
            )

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
