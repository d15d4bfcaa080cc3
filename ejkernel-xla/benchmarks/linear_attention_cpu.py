"""CPU benchmark of the XLA linear-attention engine: chunked ``gla`` against the step-by-step recurrence.

    python ejkernel-xla/benchmarks/linear_attention_cpu.py [--out bench-results/linear_attention_cpu.json]

``gla`` at B=1, H=4, K=V=64, float32, with GLA's usual gates (``log_sigmoid(x) / 16``), an initial state
and the final state returned, at T in ``--lengths`` (default 4096). Each path is the same op with a
different chunk size (``ChunkParams.chunk_size``, for both passes): 1 is the step-by-step recurrence (a ``lax.scan``
over tokens with its own backward that keeps ~2 sqrt(T) states), the others the chunked form. For
context, the last row is the same recurrence differentiated by JAX's autodiff (the reference
implementation: ``lax.scan`` storing every state). For every path:

1. forward time and forward+backward time (gradients of q, k, v, g and the initial state, jitted), the
   median of ``--repeats`` samples of the core's timer (``ejkernel.ops.timing``, as the autotuner times)
   after a warm-up; the paths take turns within each repeat so that a busy machine slows them alike;
2. the largest relative error of the output, the final state and the gradients against the reference;
3. the forward+backward program's memory from ``memory_analysis()`` (arguments + outputs + temporaries).

Prints a table (speed-up = step-by-step forward+backward time / the path's) and writes everything as JSON
to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.ops import timing
from ejkernel.testing import reference

from ejkernel_xla.gla import gla
from ejkernel_xla.params import ChunkParams

B, H, K, V = 1, 4, 64, 64
MIB = 2**20


def inputs(t: int) -> tuple[jax.Array, ...]:
    kq, kk, kv, kg, kh = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(kq, (B, t, H, K), jnp.float32)
    k = jax.random.normal(kk, (B, t, H, K), jnp.float32)
    v = jax.random.normal(kv, (B, t, H, V), jnp.float32)
    g = jax.nn.log_sigmoid(jax.random.normal(kg, (B, t, H, K), jnp.float32)) / 16
    h0 = jax.random.normal(kh, (B, H, K, V), jnp.float32)
    return q, k, v, g, h0


REFERENCE = 0  # the path key of the autodiff baseline


def path(chunk: int) -> Any:
    if chunk == REFERENCE:
        return lambda q, k, v, g, h0: reference.gla(q, k, v, g, initial_state=h0, output_final_state=True)
    fp = bp = ChunkParams(chunk_size=chunk)
    return lambda q, k, v, g, h0: gla(
        q, k, v, g, initial_state=h0, output_final_state=True, fwd_params=fp, bwd_params=bp
    )


def fwd_bwd(fn: Any) -> Any:
    def loss(*args: jax.Array) -> jax.Array:
        o, state = fn(*args)
        return jnp.sum(jnp.sin(o)) + jnp.sum(jnp.cos(state))  # cotangents that are not all ones

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))


def memory(compiled: Any) -> dict[str, int]:
    m = compiled.memory_analysis()
    out = {
        "argument_bytes": int(m.argument_size_in_bytes),
        "output_bytes": int(m.output_size_in_bytes),
        "temp_bytes": int(m.temp_size_in_bytes),
    }
    out["total_bytes"] = sum(out.values())
    return out


def relative_error(got: Any, want: Any) -> float:
    errs = [
        float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))
    ]
    return max(errs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench-results/linear_attention_cpu.json")
    ap.add_argument("--lengths", type=int, nargs="*", default=[4096])
    ap.add_argument("--chunks", type=int, nargs="*", default=[16, 32, 64, 128])
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()

    result: dict[str, Any] = {
        "config": {"B": B, "H": H, "K": K, "V": V, "dtype": "float32", "gates": "log_sigmoid(normal) / 16",
                   "jax": jax.__version__, "cpu": platform.processor() or platform.machine(),
                   "cores": os.cpu_count(), "repeats": a.repeats, "load_average": os.getloadavg()},
        "runs": [],
    }  # fmt: skip
    for t in a.lengths:
        args = inputs(t)
        chunks = [1, *a.chunks, REFERENCE]
        fwd = {c: jax.jit(path(c)) for c in chunks}
        both = {c: fwd_bwd(path(c)) for c in chunks}
        outs, grads, mem, runners = {}, {}, {}, {}
        for c in chunks:
            outs[c] = jax.block_until_ready(fwd[c](*args))  # compile + warm-up
            grads[c] = jax.block_until_ready(both[c](*args))
            mem[c] = memory(both[c].lower(*args).compile())
            for name, fn in (("fwd", fwd[c]), ("fwd_bwd", both[c])):
                runners[name, c] = timing.prepare(fn, *args)
                runners[name, c].warm()
        times: dict[str, dict[int, list[float]]] = {"fwd": {c: [] for c in chunks}, "fwd_bwd": {c: [] for c in chunks}}
        for _ in range(a.repeats):
            for c in chunks:
                for name in ("fwd", "fwd_bwd"):
                    times[name][c].append(runners[name, c].sample())
        med = {name: {c: float(np.median(v)) for c, v in per.items()} for name, per in times.items()}

        print(f"\ngla, B={B} H={H} T={t} K={K} V={V} float32, median of {a.repeats} runs (ms)")
        print(f"{'path':>14} {'fwd':>8} {'fwd+bwd':>9} {'speed-up':>9} {'memory MiB':>10} {'err vs ref':>10}")
        for c in chunks:
            err = relative_error((outs[c], grads[c]), (outs[REFERENCE], grads[REFERENCE]))
            speedup = med["fwd_bwd"][1] / med["fwd_bwd"][c]
            name = {1: "step-by-step", REFERENCE: "scan+autodiff"}.get(c, f"chunk {c}")
            result["runs"].append({"T": t, "chunk": c, "fwd_s": med["fwd"][c], "fwd_bwd_s": med["fwd_bwd"][c],
                                   "fwd_bwd_speedup_vs_step": speedup, "fwd_bwd_memory": mem[c],
                                   "max_relative_error_vs_reference": err, "fwd_times_s": times["fwd"][c],
                                   "fwd_bwd_times_s": times["fwd_bwd"][c]})  # fmt: skip
            print(
                f"{name:>14} {1e3 * med['fwd'][c]:>8.1f} {1e3 * med['fwd_bwd'][c]:>9.1f} {speedup:>8.1f}x "
                f"{mem[c]['total_bytes'] / MIB:>10.1f} {err:>10.1e}",
                flush=True,
            )

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
