"""Launch-config sweep of ejkernel-triton's flash attention on the GPU, cuDNN timed in the same run.

For each shape and both causal modes: cuDNN (``jax.nn.dot_product_attention(implementation="cudnn")``)
forward and forward+backward; every forward candidate (``FwdParams``: query block, key block,
warps, stages); every backward candidate (``BwdParams``, read by the tile rule of
``interface._backward``: the dK/dV kernel holds ``kv_blocksize`` keys and streams ``q_blocksize``
queries, the dQ kernel the transpose) as forward+backward with the forward at its heuristic, plus
each backward kernel alone (delta pre-pass, dK/dV, dQ).

Method and FLOPs as ``flash_attention_gpu.py`` (whose helpers this imports): inputs seeded the same
way, every timed output checked against the float32 reference first, then timed with the core's timer
(``ejkernel.ops.timing.measure``, as the autotuner times). Candidates are ``BMxBNxWARPSxSTAGES``. Rows
go to ``--out`` (JSON, rewritten after each row) and the best of each kind is printed last.

    python ejkernel-triton/benchmarks/sweep_flash_attention.py --shapes 2x16x8192x128 --out sweep.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.ops import timing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from flash_attention_gpu import BUDGET_S, flops, inputs, reference, reference_loss  # noqa: E402

Cand = tuple[int, int, int, int]

# Per head dim: forward and backward candidates, the heuristic first (backward: then the symmetric
# config it replaced, among others). Left out after compiling for sm_90 without a GPU: those that
# spill registers or need more than 227 KB of shared memory. BENCHMARKS.md has what they measured.
FWD_CANDS: dict[int, list[Cand]] = {
    128: [(128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3), (128, 32, 4, 3)],
    64: [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 4, 4), (64, 128, 4, 3)],
}
BWD_CANDS: dict[int, list[Cand]] = {
    128: [(64, 128, 8, 3), (64, 64, 8, 2), (64, 128, 8, 2), (32, 128, 8, 3), (32, 64, 8, 3), (16, 128, 8, 2)],
    64: [(64, 128, 8, 3), (64, 64, 4, 3), (32, 128, 8, 3), (64, 128, 8, 2), (16, 128, 4, 4), (32, 64, 4, 3)],
}


def parse_cands(text: str | None, default: list[Cand]) -> list[Cand]:
    if not text:
        return default
    if text == "none":
        return []
    return [tuple(int(x) for x in c.split("x")) for c in text.split(",")]  # type: ignore[misc]


def rel_err(got: Any, want: Any) -> float:
    """‖got − want‖/‖want‖ in float32 on the device (NaN and inf give inf)."""
    got, want = jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32)
    err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
    return err if err == err and err != float("inf") and bool(jnp.all(jnp.isfinite(got))) else float("inf")


def attention_fn(causal: bool, fwd: Cand | None, bwd: Cand | None) -> Callable[..., Any]:
    """ejkernel-triton's flash attention (its custom_vjp) at the given launch configs."""
    from ejkernel.kernels.params import BwdParams, FwdParams

    from ejkernel_triton.flash_attention import interface as itf

    fp = FwdParams(*fwd) if fwd else None
    bp = BwdParams(*bwd) if bwd else None

    def fn(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        kw = {**itf._DEFAULTS, "causal": causal, "fwd_params": fp, "bwd_params": bp}
        cfg, aux = itf._prepare(q, k, v, None, **kw)
        return itf._attention(cfg, q, k, v, None, aux)

    return fn


def kernel_parts(causal: bool, bwd: Cand, q: jax.Array, k: jax.Array, v: jax.Array, ct: jax.Array) -> dict[str, float]:
    """Milliseconds of each backward kernel alone (delta, dK/dV, dQ) at ``bwd``."""
    from ejkernel.kernels.params import BwdParams

    from ejkernel_triton.flash_attention import interface as itf

    cfg, aux = itf._prepare(q, k, v, None, **{**itf._DEFAULTS, "causal": causal, "bwd_params": BwdParams(*bwd)})
    o, lse = jax.jit(lambda q, k, v, aux: itf._forward(cfg, q, k, v, None, aux))(q, k, v, aux)
    do = ct.astype(q.dtype)
    res = (q, k, v, None, aux, o, lse)
    delta = jax.jit(lambda o, do: itf._bwd_delta(cfg, o, do))(o, do)
    fns = {
        "delta_ms": (jax.jit(lambda o, do: itf._bwd_delta(cfg, o, do)), (o, do)),
        "dkdv_ms": (jax.jit(lambda res, do, delta: itf._bwd_dkdv(cfg, res, do, delta)), (res, do, delta)),
        "dq_ms": (jax.jit(lambda res, do, delta: itf._bwd_dq(cfg, res, do, delta)), (res, do, delta)),
    }
    return {name: timing.measure(f, *args, budget_s=BUDGET_S).seconds * 1e3 for name, (f, args) in fns.items()}


class Sweep:
    def __init__(self, out: str, budget_s: float) -> None:
        self.out, self.budget_s, self.started = out, budget_s, time.perf_counter()
        self.rows: list[dict[str, Any]] = []

    def over_budget(self) -> bool:
        return time.perf_counter() - self.started > self.budget_s

    def measure(
        self,
        kind: str,
        cfg: Any,
        fn: Callable[..., Any],
        shape: tuple[int, int, int, int],
        causal: bool,
        bwd: bool,
        args: tuple[Any, ...],
        ref: Any,
    ) -> dict[str, Any]:
        b, h, t, d = shape
        q, k, v, ct = args
        row: dict[str, Any] = {"kind": kind, "cfg": cfg, "B": b, "H": h, "T": t, "D": d, "causal": causal}
        row["pass"] = "fwd+bwd" if bwd else "fwd"
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
            else:
                m = timing.measure(f, q, k, v, budget_s=BUDGET_S)
                row["ms"] = m.seconds * 1e3
                row["tflops"] = flops(b, h, t, d, causal, bwd) / m.seconds / 1e12
                row["spread_pct"] = round(100 * m.spread, 2)
        except Exception as e:  # noqa: BLE001 - a failing candidate is a result too
            row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"
        row["wall_s"] = round(time.perf_counter() - started, 2)
        self.add(row)
        return row

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
        self.save()

    def save(self) -> None:
        os.makedirs(os.path.dirname(self.out) or ".", exist_ok=True)
        meta = {
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "device": jax.devices()[0].device_kind,
            "jax": jax.__version__,
            "command": " ".join(sys.argv),
            "elapsed_s": round(time.perf_counter() - self.started, 1),
        }
        with open(self.out, "w") as f:
            json.dump({"meta": meta, "rows": self.rows}, f, indent=1)


def sweep_shape(sw: Sweep, shape: tuple[int, int, int, int], args: argparse.Namespace) -> None:
    b, h, t, d = shape
    q, k, v, ct = inputs(*shape)
    data = (q, k, v, ct)
    refs = {}
    for causal in (False, True):
        out = jax.jit(reference, static_argnums=3)(q, k, v, causal)
        grads = jax.jit(jax.grad(reference_loss, argnums=(0, 1, 2)), static_argnums=4)(q, k, v, ct, causal)
        refs[causal] = (out, grads)

    def cudnn(causal: bool) -> Callable[..., Any]:
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")

    if args.peers != "none":
        for bwd in (False, True):
            for causal in (False, True):
                sw.measure("cudnn", None, cudnn(causal), shape, causal, bwd, data, refs[causal][bwd])
    for c in parse_cands(args.fwd, FWD_CANDS[d]):
        for causal in (False, True):
            if not sw.over_budget():
                sw.measure("fwd", list(c), attention_fn(causal, c, None), shape, causal, False, data, refs[causal][0])
    for c in parse_cands(args.bwd, BWD_CANDS[d]):
        for causal in (False, True):
            if sw.over_budget():
                continue
            row = sw.measure("bwd", list(c), attention_fn(causal, None, c), shape, causal, True, data, refs[causal][1])
            if "ms" in row and args.parts:
                try:
                    row.update(kernel_parts(causal, c, q, k, v, ct))
                    sw.save()
                except Exception as e:  # noqa: BLE001
                    row["parts_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    if args.peers == "start+end":  # peers again at the end: how much the machine drifted over the sweep
        for bwd in (False, True):
            for causal in (False, True):
                sw.measure("cudnn (again)", None, cudnn(causal), shape, causal, bwd, data, refs[causal][bwd])
    del refs


def summary(rows: list[dict[str, Any]]) -> None:
    keys = sorted(
        {(r["B"], r["H"], r["T"], r["D"], r["causal"], r["pass"]) for r in rows}, key=lambda x: (-x[2], -x[3])
    )
    print("| shape | causal | pass | cuDNN | best triton (cfg) | ratio | heuristic (first cfg) |")
    print("|---|---|---|---|---|---|---|")
    for key in keys:
        same = [r for r in rows if (r["B"], r["H"], r["T"], r["D"], r["causal"], r["pass"]) == key and "tflops" in r]
        peer = [r["tflops"] for r in same if r["kind"].startswith("cudnn")]
        ours = [r for r in same if r["kind"] in ("fwd", "bwd")]
        if not ours:
            continue
        best = max(ours, key=lambda r: r["tflops"])
        cud = max(peer) if peer else float("nan")
        print(
            f"| B{key[0]} H{key[1]} T{key[2]} D{key[3]} | {key[4]} | {key[5]} | {cud:.0f} | "
            f"{best['tflops']:.0f} ({'x'.join(map(str, best['cfg']))}) | {best['tflops'] / cud:.2f} | "
            f"{ours[0]['tflops']:.0f} |"
        )
    for r in rows:
        if "error" in r:
            print(f"  {r['kind']} {r['cfg']} T{r['T']} D{r['D']} causal={r['causal']} {r['pass']}: {r['error'][:200]}")
    for r in rows:
        if "dkdv_ms" in r:
            print(
                f"  parts {'x'.join(map(str, r['cfg']))} T{r['T']} D{r['D']} causal={r['causal']}: "
                f"delta {r['delta_ms']:.3f} dkdv {r['dkdv_ms']:.3f} dq {r['dq_ms']:.3f} ms (fwd+bwd {r['ms']:.3f})"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench-results/sweep_flash_attention.json")
    parser.add_argument("--shapes", default="2x16x8192x128", help="BxHxTxD, comma-separated")
    parser.add_argument(
        "--fwd", default=None, help="forward candidates BMxBNxWARPSxSTAGES,... (default: per D; none: skip)"
    )
    parser.add_argument("--bwd", default=None, help="backward candidates q_blocksize x kv_blocksize x warps x stages")
    parser.add_argument("--parts", action="store_true", help="also time each backward kernel alone")
    parser.add_argument(
        "--peers", choices=("start+end", "start", "none"), default="start+end", help="when to time cuDNN"
    )
    parser.add_argument("--budget-s", type=float, default=1e9, help="start no candidate after this many seconds")
    args = parser.parse_args()
    sw = Sweep(args.out, args.budget_s)
    for s in args.shapes.split(","):
        sweep_shape(sw, tuple(int(x) for x in s.split("x")), args)  # type: ignore[arg-type]
    sw.save()
    summary(sw.rows)


if __name__ == "__main__":
    main()
