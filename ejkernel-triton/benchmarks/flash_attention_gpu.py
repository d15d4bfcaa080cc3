"""Flash attention on the GPU: ejkernel against its peers, measured in one run on the same inputs.

Peers: cuDNN and XLA through ``jax.nn.dot_product_attention``, JAX's Pallas Triton (``mha``) and
Mosaic GPU (``attention_mgpu``) kernels, and the published ejkernel 0.0.80.3 (it shares our import
name, so it runs in a child process from ``--old-ejkernel-path`` on the same seeded inputs).
Every timed output is checked against a float32 reference first (relative error, NaN fails), then timed
with the core's timer (``ejkernel.ops.timing.measure``, as the autotuner times): the median of up to 25
samples, each bursts of launches with the fixed cost of a launch cancelled, calls looped on the device
where one call is short; ``spread_pct`` is the samples' interquartile range over their median.

FLOPs: forward ``4·B·H·T·S·D`` (halved when causal), forward+backward 3.5× that.

    python ejkernel-triton/benchmarks/flash_attention_gpu.py --out bench-results/flash_attention_gpu.json
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

SHAPES = [  # (B, H, T, D)
    (2, 16, 8192, 128),
    (2, 16, 2048, 128),
    (2, 16, 8192, 64),
]


def inputs(b: int, h: int, t: int, d: int, dtype: Any = jnp.bfloat16) -> tuple[jax.Array, ...]:
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(kk, (b, t, h, d), jnp.float32).astype(dtype) for kk in keys[:3])
    return q, k, v, jax.random.normal(keys[3], (b, t, h, d), jnp.float32)


def flops(b: int, h: int, t: int, d: int, causal: bool, bwd: bool) -> float:
    f = 4.0 * b * h * t * t * d * (0.5 if causal else 1.0)
    return f * (3.5 if bwd else 1.0)


BUDGET_S = 1.0  # device time of one measurement's samples
TIMING_PATH_ENV = "EJKERNEL_BENCH_TIMING_PATH"


@functools.cache
def timing() -> ModuleType:
    """The core's timer module. The child that runs the published ejkernel (which has the same import
    name and no such module) loads it from the file its parent names in ``EJKERNEL_BENCH_TIMING_PATH``."""
    path = os.environ.get(TIMING_PATH_ENV)
    if not path:
        from ejkernel.ops import timing as module

        return module
    spec = importlib.util.spec_from_file_location("ejkernel_bench_timing", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses looks its module up
    spec.loader.exec_module(module)
    return module


def rel_err(got: Any, want: Any) -> float:
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    want = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def reference(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> jax.Array:
    qf, kf, vf = (x.astype(jnp.float32) for x in (q, k, v))
    s = jnp.einsum("bthd,bshd->bhts", qf, kf, precision="highest") * q.shape[-1] ** -0.5
    if causal:
        t = q.shape[1]
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), vf, precision="highest")


def autotuned(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn`` traced with ``EJKERNEL_AUTOTUNE_POLICY=autotune`` (the policy is read at call time)."""
    os.environ["EJKERNEL_AUTOTUNE_POLICY"] = "autotune"
    try:
        return fn(*args, **kwargs)
    finally:
        del os.environ["EJKERNEL_AUTOTUNE_POLICY"]


def reference_loss(q: jax.Array, k: jax.Array, v: jax.Array, ct: jax.Array, causal: bool) -> jax.Array:
    return jnp.sum(reference(q, k, v, causal) * ct)


def peers(causal: bool, d: int) -> dict[str, Callable[..., Any]]:
    from ejkernel.modules import flash_attention

    out: dict[str, Callable[..., Any]] = {
        "ejkernel triton": lambda q, k, v: flash_attention(q, k, v, causal=causal, platform="triton"),
        # backend="any": the blockwise XLA kernel itself, not cuDNN (which ejkernel-xla serves as xla:gpu).
        "ejkernel xla": lambda q, k, v: flash_attention(q, k, v, causal=causal, platform="xla", backend="any"),
        "ejkernel auto": lambda q, k, v: autotuned(flash_attention, q, k, v, causal=causal),
        "cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn"),
        "xla dense": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla"),
    }
    try:
        from jax.experimental.pallas.ops.gpu import attention as pallas_attention

        out["pallas triton"] = lambda q, k, v: pallas_attention.mha(
            q, k, v, segment_ids=None, sm_scale=d**-0.5, causal=causal
        )
    except Exception as e:  # noqa: BLE001 - a peer that is missing is reported, not fatal
        print(f"pallas triton unavailable: {e}", file=sys.stderr)
    try:
        from jax.experimental.pallas.ops.gpu import attention_mgpu

        cfg = attention_mgpu.TuningConfig(
            block_q=64, block_kv=64 if d > 64 else 128, max_concurrent_steps=2, causal=causal
        )
        # Mosaic GPU's kernel takes float16 only: it gets float16 inputs (see FP16_PEERS).
        out["pallas mosaic"] = lambda q, k, v: attention_mgpu.attention(q * jnp.float16(d**-0.5), k, v, cfg)
    except Exception as e:  # noqa: BLE001
        print(f"pallas mosaic unavailable: {e}", file=sys.stderr)
    return out


FP16_PEERS = ("pallas mosaic",)


def measure(
    name: str, fn: Callable[..., Any], shape: tuple[int, ...], causal: bool, bwd: bool, ref: Any
) -> dict[str, Any]:
    b, h, t, d = shape
    dtype = jnp.float16 if name in FP16_PEERS else jnp.bfloat16
    q, k, v, ct = inputs(*shape, dtype=dtype)
    row: dict[str, Any] = {
        "peer": name,
        "B": b,
        "H": h,
        "T": t,
        "D": d,
        "causal": causal,
        "pass": "fwd+bwd" if bwd else "fwd",
        "dtype": jnp.dtype(dtype).name,
    }
    started = time.perf_counter()
    try:
        if bwd:
            f = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * ct), argnums=(0, 1, 2)))
        else:
            f = jax.jit(fn)
        got = f(q, k, v)
        err = max(rel_err(g, r) for g, r in zip(got, ref, strict=True)) if bwd else rel_err(got, ref)
        row["rel_err"] = err
        if not err < 2e-2:
            row["error"] = f"wrong result: relative error {err:.3g}"
            return row
        m = timing().measure(f, q, k, v, budget_s=BUDGET_S)
        row["ms"] = m.seconds * 1e3
        row["tflops"] = flops(b, h, t, d, causal, bwd) / m.seconds / 1e12
        row["spread_pct"] = round(100 * m.spread, 2)
    except Exception as e:  # noqa: BLE001 - a failing peer is a result too
        row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:600]}"
    row["wall_s"] = time.perf_counter() - started
    return row


def old_ejkernel_rows(path: str, shapes: str | None) -> list[dict[str, Any]]:
    """Run the published ejkernel in a child process (it is also called ``ejkernel``)."""
    env = {**os.environ, "PYTHONPATH": path, TIMING_PATH_ENV: timing().__file__}
    cmd = [sys.executable, __file__, "--as-old-ejkernel"] + (["--shapes", shapes] if shapes else [])
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    if run.returncode != 0:
        return [{"peer": "ejkernel 0.0.80.3", "error": run.stderr.strip().splitlines()[-1] if run.stderr else "failed"}]
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench-results/flash_attention_gpu.json")
    parser.add_argument("--old-ejkernel-path", default=None, help="a --target dir holding ejkernel==0.0.80.3")
    parser.add_argument("--as-old-ejkernel", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--only", nargs="*", default=None, help="peer names to run")
    parser.add_argument("--shapes", default=None, help="e.g. 2x16x8192x128,2x16x2048x128")
    args = parser.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES

    rows: list[dict[str, Any]] = []
    for shape in shapes:
        for causal in (False, True):
            b, h, t, d = shape
            q, k, v, ct = inputs(*shape)
            ref_out = jax.jit(reference, static_argnums=3)(q, k, v, causal)
            ref_grads = jax.jit(jax.grad(reference_loss, argnums=(0, 1, 2)), static_argnums=4)(q, k, v, ct, causal)
            if args.as_old_ejkernel:
                from ejkernel.modules import flash_attention as old

                todo = {"ejkernel 0.0.80.3": lambda q, k, v, c=causal: old(q, k, v, causal=c, platform="triton")}
            else:
                todo = peers(causal, d)
                if args.only:
                    todo = {k_: f for k_, f in todo.items() if k_ in args.only}
            for bwd in (False, True):
                for name, fn in todo.items():
                    row = measure(name, fn, shape, causal, bwd, ref_grads if bwd else ref_out)
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
                    if not args.as_old_ejkernel:
                        save(args.out, rows)  # a run cut short still leaves what it measured
            del ref_out, ref_grads
    if args.as_old_ejkernel:
        print(json.dumps(rows))
        return
    if args.old_ejkernel_path:
        rows += old_ejkernel_rows(args.old_ejkernel_path, args.shapes)

    save(args.out, rows)
    print_table(rows)


def save(path: str, rows: list[dict[str, Any]]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "commit": os.environ.get("GIT_COMMIT", "unknown"),
        "command": " ".join(sys.argv),
    }
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


def print_table(rows: list[dict[str, Any]]) -> None:
    keys = sorted(
        {(r.get("B"), r.get("H"), r.get("T"), r.get("D"), r.get("causal"), r.get("pass")) for r in rows if "T" in r},
        key=lambda x: (x[5], -x[2], -x[3], x[4]),
    )
    names = list(dict.fromkeys(r["peer"] for r in rows))
    print("| shape | causal | pass | " + " | ".join(names) + " |")
    print("|---|---|---|" + "---|" * len(names))
    for key in keys:
        cells = []
        for n in names:
            r = next(
                (
                    r
                    for r in rows
                    if r["peer"] == n
                    and (r.get("B"), r.get("H"), r.get("T"), r.get("D"), r.get("causal"), r.get("pass")) == key
                ),
                None,
            )
            cells.append("" if r is None else (f"{r['tflops']:.0f}" if "tflops" in r else "fail"))
        print(f"| B{key[0]} H{key[1]} T{key[2]} D{key[3]} | {key[4]} | {key[5]} | " + " | ".join(cells) + " |")
    for r in rows:
        if "error" in r:
            print(f"  {r['peer']} {r.get('T')}x{r.get('D')} causal={r.get('causal')} {r.get('pass')}: {r['error']}")


if __name__ == "__main__":
    main()
