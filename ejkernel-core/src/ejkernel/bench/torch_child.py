"""Torch-based peers (flash-linear-attention) in a child process, on the parent's inputs.

The parent writes the op's arrays as ``.npy`` files, runs ``python -m ejkernel.bench.torch_child DIR`` (a
fresh process: fla's Triton driver fails in a process that loaded JAX's), and reads back ``result.json``
(seconds: the median of 25 CUDA-event timings of a loop of calls after warm-up, or the reason it could not
run) and the outputs (``out*.npy``), which it checks against its own float32 reference.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

NAMES = {
    "gla": ("q", "k", "v", "g"),
    "gated_delta_rule": ("q", "k", "v", "g", "beta"),
    "lightning_attn": ("q", "k", "v", "slope"),
    "recurrent": ("q", "k", "v", "g"),
}


@functools.cache
def _triton_cache() -> str:
    """A Triton cache directory for this process's children, removed when the process exits."""
    d = tempfile.mkdtemp(prefix="ejkernel-bench-triton-")
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    return d


def run_child(
    op: str,
    module: str,
    shape: dict[str, Any],
    inputs: Any,
    pass_: str,
    ref: Any,
    tol: float,
    rel_err: Callable[[Any, Any], float],
) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    from ejkernel.bench.cases import CASES

    if jax.default_backend() != "gpu":
        return {"status": "skipped", "reason": f"needs a GPU (this is {jax.default_backend()})"}
    if op == "recurrent" and (shape.get("gk") or shape.get("gv")):
        return {"status": "skipped", "reason": "fla's chunk_simple_gla has a scalar gate only (no key or value gate)"}
    with tempfile.TemporaryDirectory() as d:
        for name, a in zip(NAMES[op], inputs.args, strict=True):
            np.save(Path(d) / f"{name}.npy", np.asarray(a.astype(jnp.float32)))
        if pass_ == "fwd_bwd":  # the cotangent the parent's gradients used (ejkernel.bench.run._pass_fn)
            out_shape = jax.eval_shape(
                lambda *a: CASES[op].call(None, type(inputs)(a, inputs.kwargs, inputs.diff)), *inputs.args
            )
            np.save(Path(d) / "ct.npy", np.asarray(jax.random.normal(jax.random.key(1), out_shape.shape, jnp.float32)))
        Path(d, "task.json").write_text(json.dumps({"op": op, "pass": pass_, "dtype": inputs.args[0].dtype.name}))
        # Triton's (and fla's autotune) caches need a writable directory: an empty TRITON_CACHE_DIR or HOME counts
        # as none (Triton then raises "Could not create or locate cache dir", seen on the GPU machine). One
        # directory for every child of this run: each case then reuses the kernels that earlier ones compiled
        # (a fresh one per case took fla 50-80 s a case on the H200, mostly compiling).
        env = {**os.environ, "TRITON_CACHE_DIR": os.environ.get("TRITON_CACHE_DIR") or _triton_cache()}
        env["HOME"] = os.environ.get("HOME") or d
        env.setdefault("FLA_CACHE_RESULTS", "0")  # fla's autotune results stay in the process
        proc = subprocess.run(
            [sys.executable, "-m", "ejkernel.bench.torch_child", d],
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        result_file = Path(d, "result.json")
        if not result_file.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            return {"status": "failed", "reason": f"child process failed: {tail[0][:400]}"}
        result = json.loads(result_file.read_text())
        if result.get("skip"):
            return {"status": "skipped", "reason": result["skip"]}
        if result.get("fail"):
            return {"status": "failed", "reason": result["fail"]}
        outs = [np.load(Path(d) / f"out{i}.npy") for i in range(result["outputs"])]
    err = rel_err(outs[0] if pass_ == "fwd" else tuple(outs), ref if pass_ == "fwd" else ref[1])  # ref: (loss, grads)
    if not err <= tol:
        return {"status": "failed", "error": err, "reason": f"wrong result: relative error {err:.3g} > {tol:g}"}
    seconds = float(result["seconds"])
    return {
        "status": "ok",
        "error": err,
        "seconds": seconds,
        "spread": result["spread"],
        "value": CASES[op].work(shape, pass_, inputs.args[0].dtype) / seconds / 1e12,
        "timer": {"method": "cuda-events", "calls": result["calls"], "samples": result["samples"]},
    }


def _child(d: Path) -> dict[str, Any]:  # pragma: no cover - runs on a GPU machine with fla installed
    task = json.loads((d / "task.json").read_text())
    try:
        import torch
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.gla import chunk_gla
        from fla.ops.simple_gla import chunk_simple_gla
    except Exception as e:  # noqa: BLE001
        return {"skip": f"fla does not import: {type(e).__name__}: {e}"}
    if not torch.cuda.is_available():
        return {"skip": "torch sees no GPU"}
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[task["dtype"]]
    op = task["op"]
    args = [torch.from_numpy(np.load(d / f"{n}.npy")).cuda().to(dtype) for n in NAMES[op]]
    fn: Callable[..., Any] = {"gla": chunk_gla, "gated_delta_rule": chunk_gated_delta_rule}.get(op, chunk_simple_gla)
    if op == "lightning_attn":  # a per-head decay exp(-slope): simple gla's log gate -slope at every step
        slope = torch.from_numpy(np.load(d / "slope.npy")).cuda()
        b, t = args[0].shape[:2]
        gate = (-slope).expand(b, t, slope.shape[0]).contiguous()
        args = args[:3]  # the gradients the parent compares: q, k, v (slope's is not timed)
        fn = lambda q, k, v: chunk_simple_gla(q, k, v, g=gate)  # noqa: E731
    ct = None

    def call() -> Any:
        if task["pass"] == "fwd":
            return (fn(*args)[0],)
        xs = [a.detach().requires_grad_(True) for a in args]
        out = fn(*xs)[0]
        return torch.autograd.grad(out.float(), xs, grad_outputs=ct)

    try:
        if task["pass"] == "fwd_bwd":  # the parent's cotangent, so that the gradients compare
            ct = torch.from_numpy(np.load(d / "ct.npy")).cuda()
        outs = call()
        torch.cuda.synchronize()
        calls = 1
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        calls = max(1, int(2.0 / max(start.elapsed_time(end), 1e-3)))  # ~2 ms of work a sample
        samples = []
        for _ in range(25):
            start.record()
            for _ in range(calls):
                call()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / calls)
    except Exception as e:  # noqa: BLE001 - fla refuses some cases (its gated backward on Hopper, Triton < 3.7.1)
        where = traceback.extract_tb(e.__traceback__)[-1]  # the raising line: fla's refusal or a setup problem
        where_s = f" (at {Path(where.filename).name}:{where.lineno})"
        return {"fail": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}{where_s}"}
    for i, o in enumerate(outs):
        np.save(d / f"out{i}.npy", o.float().cpu().numpy())
    s = sorted(samples)
    med = s[len(s) // 2]
    return {
        "outputs": len(outs),
        "seconds": med,
        "spread": (s[3 * len(s) // 4] - s[len(s) // 4]) / med,
        "calls": calls,
        "samples": len(s),
    }


if __name__ == "__main__":  # pragma: no cover
    folder = Path(sys.argv[1])
    (folder / "result.json").write_text(json.dumps(_child(folder)))
