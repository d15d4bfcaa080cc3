"""ejkernel-pallas's Mosaic GPU flash attention forward on a Hopper GPU, against its peers in one run.

Peers, on the same inputs in the same process: cuDNN through ``jax.nn.dot_product_attention`` and
JAX's own Mosaic GPU kernel (``jax.experimental.pallas.ops.gpu.attention_mgpu``, given ``q * scale``:
it has no scale argument). Each timed output is first checked against a float32 reference on a
slice of heads (relative error; NaN fails). Timing: the core's timer (``ejkernel.ops.timing``, as the
autotuner times) prepares each peer (compiled, warmed, its calls looped on the device where one is
short); one sample is a burst of launches less one launch (the fixed cost of a launch cancels); the
peers take turns, ``--samples`` rounds, and each reports its median (and the spread of its samples).
FLOPs: ``4·B·H·T·S·D``, halved when causal.

    python ejkernel-pallas/benchmarks/flash_attention_gpu.py --out bench-results/flash_attention_pallas_gpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.ops import timing
from ejkernel.ops.utils.datacarrier import FwdParams

from ejkernel_pallas.gpu.flash_attention import flash_attention

SHAPES = [(2, 16, 8192, 128)]  # (B, H, T, D); T == S
DTYPES = ("bfloat16", "float16")


def inputs(b: int, h: int, t: int, d: int, dtype: str) -> tuple[jax.Array, ...]:
    keys = jax.random.split(jax.random.key(0), 3)
    return tuple(jax.random.normal(kk, (b, t, h, d), jnp.float32).astype(dtype) for kk in keys)


def reference_slice(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool, heads: int = 2) -> jax.Array:
    """float32 attention of batch 0, the first ``heads`` heads: [1, T, heads, D]."""
    qf, kf, vf = (x[:1, :, :heads].astype(jnp.float32) for x in (q, k, v))
    s = jnp.einsum("bthd,bshd->bhts", qf, kf, precision="highest") * q.shape[-1] ** -0.5
    if causal:
        t = q.shape[1]
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), vf, precision="highest")


def rel_err(got: Any, want: Any) -> float:
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    want = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def peers(causal: bool, d: int, variants: list[tuple[int, int]]) -> dict[str, Callable[..., Any]]:
    out: dict[str, Callable[..., Any]] = {
        "ejkernel pallas:gpu": lambda q, k, v: flash_attention(q, k, v, causal=causal),
    }
    for bk, stages in variants:
        p = FwdParams(kv_blocksize=bk, num_stages=stages)
        out[f"ejkernel pallas:gpu bk{bk} st{stages}"] = lambda q, k, v, p=p: flash_attention(
            q, k, v, causal=causal, fwd_params=p
        )
    out["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
    try:
        from jax.experimental.pallas.ops.gpu import attention_mgpu

        cfg = attention_mgpu.TuningConfig(
            block_q=64, block_kv=128 if d <= 128 else 64, max_concurrent_steps=2, causal=causal
        )
        out["jax attention_mgpu"] = lambda q, k, v: attention_mgpu.attention(
            q * jnp.asarray(d**-0.5, q.dtype), k, v, cfg
        )
    except Exception as e:  # noqa: BLE001 - a missing peer is reported, not fatal
        print(f"jax attention_mgpu unavailable: {e}", file=sys.stderr)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench-results/flash_attention_pallas_gpu.json")
    parser.add_argument("--shapes", default=None, help="BxHxTxD,... (default 2x16x8192x128)")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--causal", default="0,1", help="0, 1 or 0,1")
    parser.add_argument("--variants", default="", help="extra launch configs of ours, e.g. 128:3,64:3")
    parser.add_argument("--samples", type=int, default=20)
    args = parser.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    variants = [(int(a), int(b)) for a, b in (v.split(":") for v in args.variants.split(",") if v)]

    rows: list[dict[str, Any]] = []
    for b, h, t, d in shapes:
        for dtype in args.dtypes.split(","):
            for causal in (c == "1" for c in args.causal.split(",")):
                q, k, v = inputs(b, h, t, d, dtype)
                want = jax.jit(reference_slice, static_argnums=3)(q, k, v, causal)
                flops = 4.0 * b * h * t * t * d * (0.5 if causal else 1.0)
                todo: dict[str, tuple[timing.Runner, dict[str, Any]]] = {}
                these: list[dict[str, Any]] = []
                for name, fn in peers(causal, d, variants if (b, h, t, d) == shapes[0] else []).items():
                    row: dict[str, Any] = {"peer": name, "B": b, "H": h, "T": t, "D": d, "causal": causal}
                    row["dtype"] = dtype
                    try:
                        f = jax.jit(fn)
                        got = f(q, k, v)
                        row["rel_err"] = err = rel_err(got[:1, :, :2], want)
                        if err < (2e-2 if dtype == "bfloat16" else 4e-3):
                            runner = timing.prepare(f, q, k, v)
                            runner.warm()
                            todo[name] = (runner, row)
                        else:
                            row["error"] = f"wrong result: relative error {err:.3g}"
                    except Exception as e:  # noqa: BLE001 - a failing peer is a result too
                        row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"
                    these.append(row)
                # Rounds over the peers in turn, so that drift (clocks, heat) touches them alike.
                samples: dict[str, list[float]] = {name: [] for name in todo}
                for _ in range(args.samples):
                    for name, (runner, _row) in todo.items():
                        samples[name].append(runner.sample())
                for name, (_runner, row) in todo.items():
                    secs = statistics.median(samples[name])
                    row["ms"] = secs * 1e3
                    row["tflops"] = flops / secs / 1e12
                    row["spread_pct"] = round(100 * (max(samples[name]) - min(samples[name])) / secs, 1)
                for row in these:
                    print(json.dumps(row), file=sys.stderr, flush=True)
                rows += these
                with open(args.out, "w") as f:  # after every configuration: a run cut short keeps what it measured
                    json.dump(
                        {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}, f, indent=1
                    )

    print(f"\n{'peer':34} {'dtype':9} {'shape':18} {'causal':6} {'ms':>8} {'TFLOP/s':>8}  note")
    for r in rows:
        shape = f"{r['B']}x{r['H']}x{r['T']}x{r['D']}"
        ms = f"{r['ms']:.3f}" if "ms" in r else "-"
        tf = f"{r['tflops']:.0f}" if "tflops" in r else "-"
        note = r.get("error", f"err {r.get('rel_err', float('nan')):.1e}")[:90]
        print(f"{r['peer']:34} {r['dtype']:9} {shape:18} {r['causal']!s:6} {ms:>8} {tf:>8}  {note}")


if __name__ == "__main__":
    main()
