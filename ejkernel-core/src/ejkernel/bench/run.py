"""Run a benchmark: every implementation and peer of one op, on each shape, checked first, then timed."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.bench.cases import CASES, Case, Inputs, Shape, first, label
from ejkernel.bench.peers import TORCH_PEERS, Peer, peers_of
from ejkernel.bench.schema import SCHEMA, validate

TOLERANCE = {"float32": 2e-3, "float16": 1e-2, "bfloat16": 2e-2}  # relative error ‖out − ref‖/‖ref‖
DEFAULT_IMPL = "default"  # the op's own dispatch (no platform=): what a user's call runs


def git_commit() -> str:
    """``GIT_COMMIT`` if set, else the checkout's short HEAD (``+dirty`` with local changes), else ``unknown``."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


@jax.jit
def _square_sums(got: Any, want: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    g, w = jnp.asarray(got, jnp.float32), jnp.asarray(want, jnp.float32)
    return jnp.sum(jnp.square(g - w)), jnp.sum(jnp.square(w)), jnp.all(jnp.isfinite(g))


def rel_err(got: Any, want: Any) -> float:
    """‖got − want‖/‖want‖ over every leaf (sums of squares in float32 on the device: a host float64 copy of a
    [256, 7168, 2048] gradient took ~100 s per record); anything not finite gives inf."""
    num = den = 0.0
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        if jnp.shape(g) != jnp.shape(w):
            raise ValueError(f"output shape {jnp.shape(g)}, reference {jnp.shape(w)}")
        diff, norm, finite = _square_sums(g, w)
        if not bool(finite):
            return float("inf")
        num += float(diff)
        den += float(norm)
    return float(np.sqrt(num / den)) if den > 0 else float(np.sqrt(num))


def _pass_fn(fn: Callable[..., Any], inputs: Inputs, pass_: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """The function timed for ``pass_`` and its arguments: the call, or the loss and its gradients by a fixed
    cotangent."""
    if pass_ == "fwd":
        return jax.jit(fn), inputs.args
    out_shape = jax.eval_shape(fn, *inputs.args)
    ct = jax.random.normal(jax.random.key(1), out_shape.shape, jnp.float32)

    def loss(*args: Any) -> Any:
        return jnp.sum(first(fn(*args)).astype(jnp.float32) * ct)

    # The loss is returned too: for an op whose backward needs no residual (a matmul), a bare gradient would
    # let XLA drop the forward from the timed program.
    return jax.jit(jax.value_and_grad(loss, argnums=inputs.diff)), inputs.args


def _fail(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:500]}"


class Progress:
    """tqdm when installed, else one rewritten stderr line; silent when ``enabled`` is false."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled, self.bar = total, 0, enabled, None
        if enabled:
            try:
                from tqdm import tqdm  # type: ignore[import-untyped]

                self.bar = tqdm(total=total, file=sys.stderr, unit="case")
            except ImportError:
                pass

    def step(self, what: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_description(what[:60])
            self.bar.update(1)
        else:
            print(f"\r[{self.done}/{self.total}] {what[:100]:<100}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            print(file=sys.stderr)


def run(
    op: str,
    shapes: Sequence[Shape],
    *,
    impls: Sequence[str] | None = None,
    peers: Sequence[str] | None = None,
    dtype: str = "bfloat16",
    passes: Sequence[str] = ("fwd",),
    out_dir: str | Path | None = None,
    preset: str | None = None,
    command: str | None = None,
    budget_s: float = 1.0,
    tolerance: float | None = None,
    progress: bool = True,
) -> tuple[dict[str, Any], Path | None]:
    """Benchmark ``op``: returns the results document (``ejkernel.bench.schema``) and the file written.

    ``impls``: implementation names (``"default"``: the op's own dispatch); ``None``: every one that runs on
    this backend, and the default. ``peers``: peer names; ``None``: every peer of the op (an unavailable one is
    recorded as skipped with its reason); ``[]``: none.
    """
    from ejkernel.kernels import kernel_registry
    from ejkernel.ops import device_fingerprint, fingerprint_id, timing

    case = CASES[op]
    installed = [i.name for i in kernel_registry.implementations(case.function)]
    names = [DEFAULT_IMPL, *installed] if impls is None else list(impls)
    chosen_peers = [p for p in peers_of(op) if peers is None or p.name in peers]
    torch_peer = TORCH_PEERS.get(op)
    use_torch = torch_peer is not None and (peers is None or torch_peer[0] in peers)
    unknown = set(peers or ()) - {p.name for p in peers_of(op)} - ({torch_peer[0]} if torch_peer else set())
    if unknown:
        known = [p.name for p in peers_of(op)] + ([torch_peer[0]] if torch_peer else [])
        raise ValueError(f"{op} has no peer {sorted(unknown)}; its peers: {known}")
    fp = device_fingerprint()
    header = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": fp["device_kind"],
        "fingerprint": fingerprint_id(),
        "commit": git_commit(),
        "command": command or " ".join(["ejkernel", *sys.argv[1:]]),  # argv[1] is "bench"
    }
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "run": {**header, "fingerprint_detail": fp, "preset": preset, "op": op, "implementations": installed},
        "records": [],
    }
    path = None
    if out_dir is not None:
        stamp = header["date"].replace(":", "").replace("-", "")
        path = Path(out_dir) / f"{stamp}-{op}-{preset or 'custom'}-{header['fingerprint']}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
    jdtype = jnp.dtype(dtype)
    tol = tolerance if tolerance is not None else TOLERANCE.get(jdtype.name, 2e-2)
    total = len(shapes) * len(passes) * (len(names) + len(chosen_peers) + int(use_torch))
    bar = Progress(total, progress)

    def add(record: dict[str, Any]) -> None:
        doc["records"].append({**record, **header})
        if path is not None:  # rewritten after each record: a run cut short keeps what it measured
            path.write_text(json.dumps(doc, indent=1))
        value = record.get("value")
        bar.step(
            f"{label(record['shape'])} {record['pass']} {record['impl']}: "
            + (f"{value:.4g} {record['metric']}" if value is not None else record["status"])
        )

    try:
        for shape in shapes:
            inputs = case.make(shape, jdtype)
            for pass_ in passes:
                base = {
                    "op": op,
                    "shape": shape,
                    "dtype": jdtype.name,
                    "pass": pass_,
                    "metric": case.unit,
                    "model": case.model,
                }
                try:
                    ref_fn, ref_args = _pass_fn(
                        lambda *a, i=inputs: case.reference(Inputs(a, i.kwargs, i.diff), i), inputs, pass_
                    )
                    ref = ref_fn(*ref_args)
                except Exception as e:  # noqa: BLE001 - without a reference nothing can be checked
                    for name in names:
                        add(
                            {
                                **base,
                                "impl": name,
                                "kind": "implementation",
                                "status": "failed",
                                "reason": f"reference failed: {_fail(e)}",
                            }
                        )
                    continue
                for name in names:
                    platform = None if name == DEFAULT_IMPL else name
                    add(
                        {
                            **base,
                            "impl": name,
                            "kind": "implementation",
                            **_measure(
                                lambda *a, p=platform, i=inputs: case.call(p, Inputs(a, i.kwargs, i.diff)),
                                inputs,
                                pass_,
                                ref,
                                case,
                                shape,
                                tol,
                                budget_s,
                                timing,
                            ),
                        }
                    )
                for peer in chosen_peers:
                    add(
                        {
                            **base,
                            "impl": peer.name,
                            "kind": "peer",
                            **_peer(peer, case, shape, inputs, pass_, ref, tol, budget_s, timing),
                        }
                    )
                if use_torch and torch_peer is not None:
                    from ejkernel.bench.torch_child import run_child

                    add(
                        {
                            **base,
                            "impl": torch_peer[0],
                            "kind": "peer",
                            **run_child(op, torch_peer[1], shape, inputs, pass_, ref, tol, rel_err),
                        }
                    )
                del ref
    finally:
        bar.close()
    validate(doc)
    return doc, path


def _peer(
    peer: Peer, case: Case, shape: Shape, inputs: Inputs, pass_: str, ref: Any, tol: float, budget_s: float, timing: Any
) -> dict[str, Any]:
    reason = peer.unavailable()
    if reason is not None:
        return {"status": "skipped", "reason": reason}
    try:
        fn = peer.build(shape, inputs)
        if peer.reference is not None:
            ref_fn, args = _pass_fn(peer.reference(shape, inputs), inputs, pass_)
            ref = ref_fn(*args)
    except Exception as e:  # noqa: BLE001 - a peer that cannot be built here is recorded, not fatal
        return {"status": "failed", "reason": _fail(e)}
    return _measure(fn, inputs, pass_, ref, case, shape, tol, budget_s, timing)


def _measure(
    fn: Callable[..., Any],
    inputs: Inputs,
    pass_: str,
    ref: Any,
    case: Case,
    shape: Shape,
    tol: float,
    budget_s: float,
    timing: Any,
) -> dict[str, Any]:
    """Check ``fn`` against ``ref``; only a correct result is timed (with ``ejkernel.ops.timing``)."""
    started = time.perf_counter()
    out: dict[str, Any] = {}
    try:
        f, args = _pass_fn(fn, inputs, pass_)
        got = f(*args)
        # A forward compares what the case checks (the op's main output, or all of it); peers return their own.
        err = rel_err(first(got) if pass_ == "fwd" and not isinstance(ref, tuple) else got, ref)
        out["error"] = err if np.isfinite(err) else None
        if not err <= tol:
            return {**out, "status": "failed", "reason": f"wrong result: relative error {err:.3g} > {tol:g}"}
        m = timing.measure(f, *args, budget_s=budget_s)
        work = case.work(shape, pass_, args[0].dtype)
        out.update(
            status="ok",
            seconds=m.seconds,
            spread=m.spread,
            value=work / m.seconds / 1e12,
            timer={"method": m.method, "calls": m.calls, "samples": len(m.samples)},
        )
    except Exception as e:  # noqa: BLE001 - a failing implementation is a result too
        out.update(status="failed", reason=_fail(e))
    out["wall_s"] = round(time.perf_counter() - started, 3)
    return out


def shapes_of(op: str, texts: Iterable[str]) -> list[Shape]:
    return [CASES[op].parse(t) for t in texts]
