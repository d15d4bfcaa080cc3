"""One-off: the H200 flash-attention results of 2026-11-29/30 (the plugins' old benchmark scripts' JSON) in the
``ejkernel-bench/1`` schema, so that BENCHMARKS.md's tables are generated from them. The originals stay where
they were; each converted record keeps the date, commit and command of the run that measured it.

    python benchmarks/convert_legacy.py   # writes benchmarks/results/2026-11-*-h200-flash_attention*.json
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ejkernel.bench.cases import CASES
from ejkernel.bench.schema import SCHEMA, validate

ROOT = Path(__file__).resolve().parent.parent
SOURCES = {
    "2026-11-29-h200-flash_attention": "ejkernel-triton/benchmarks/results/2026-11-29-h200.json",
    "2026-11-30-h200-flash_attention": "ejkernel-triton/benchmarks/results/2026-11-30-h200.json",
    "2026-11-30-h200-flash_attention-mosaic_gpu": "ejkernel-pallas/benchmarks/results/2026-11-30-h200.json",
}
IMPLS = {
    "ejkernel triton": "triton",
    "ejkernel xla": "xla",
    "ejkernel auto": "default (autotuned)",
    "ejkernel pallas:gpu": "mosaic_gpu",
}
PEERS = {
    "cudnn": "cudnn",
    "xla dense": "jax-xla",
    "pallas triton": "pallas-triton",
    "pallas mosaic": "pallas-mosaic",
    "jax attention_mgpu": "pallas-mosaic",
    "ejkernel 0.0.80.3": "ejkernel-0.0.80.3",
}


def record(row: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    name = row["peer"]
    if name.startswith("ejkernel pallas:gpu "):  # the pallas script's launch-config variants
        impl, kind = "mosaic_gpu " + name.removeprefix("ejkernel pallas:gpu "), "implementation"
    elif name in IMPLS:
        impl, kind = IMPLS[name], "implementation"
    else:
        impl, kind = PEERS.get(name, name), "peer"
    case = CASES["flash_attention"]
    out: dict[str, Any] = {
        "op": "flash_attention",
        "impl": impl,
        "kind": kind,
        "shape": {
            "B": row["B"],
            "H": row["H"],
            "K": 0,
            "T": row["T"],
            "S": 0,
            "D": row["D"],
            "causal": bool(row["causal"]),
        },
        "dtype": row.get("dtype", "float16" if name == "pallas mosaic" else "bfloat16"),
        "pass": "fwd_bwd" if row.get("pass") == "fwd+bwd" else "fwd",
        "metric": case.unit,
        "model": case.model,
        "date": meta["date"],
        "device": meta["device"],
        "fingerprint": "unknown (converted)",
        "commit": meta.get("commit", "uncommitted"),
        "command": meta["command"],
    }
    if row.get("rel_err") is not None:
        out["error"] = row["rel_err"]
    if "tflops" in row:
        out.update(status="ok", value=row["tflops"], seconds=row["ms"] / 1e3)
        if "spread_pct" in row:
            out["spread"] = row["spread_pct"] / 100
    else:
        out.update(status="failed", reason=row.get("error", "no figure recorded"))
    return out


def convert(stem: str, source: str) -> dict[str, Any]:
    doc = json.loads((ROOT / source).read_text())
    runs = (
        doc["runs"] if "runs" in doc else [{"meta": {k: v for k, v in doc.items() if k != "rows"}, "rows": doc["rows"]}]
    )
    records = [record(r, run["meta"]) for run in runs for r in run["rows"] if "T" in r]
    out = {
        "schema": SCHEMA,
        "run": {
            "date": runs[0]["meta"]["date"],
            "device": runs[0]["meta"]["device"],
            "fingerprint": "unknown (converted)",
            "commit": runs[0]["meta"].get("commit", "uncommitted"),
            "command": "python benchmarks/convert_legacy.py",
            "preset": None,
            "op": "flash_attention",
            "source": f"converted from {source}, measured by the commands on each record "
            f"({Path(source).parts[0]}/benchmarks/flash_attention_gpu.py, since replaced by `ejkernel bench`)",
        },
        "records": records,
    }
    validate(out)
    return out


if __name__ == "__main__":
    for stem, source in SOURCES.items():
        path = ROOT / "benchmarks" / "results" / f"{stem}.json"
        path.write_text(json.dumps(convert(stem, source), indent=1) + "\n")
        print(f"wrote {path.relative_to(ROOT)}")
