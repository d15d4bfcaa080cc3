"""The results file of ``ejkernel bench`` (one JSON document per run), and its check.

Schema ``ejkernel-bench/1``::

    {
      "schema": "ejkernel-bench/1",
      "run": {                      # the run as a whole
        "date": "2026-12-02T07:00:00Z", "device": "NVIDIA H200", "fingerprint": "nvidia-h200-3f2a9c1b0d",
        "fingerprint_detail": {...},   # ejkernel.ops.device_fingerprint() (absent in converted files)
        "commit": "824dbdc", "command": "ejkernel bench flash_attention --preset flash-h200 --out DIR",
        "preset": "flash-h200" | null, "op": "flash_attention", "implementations": ["cudnn", "triton", ...],
        "source": "..."                # converted files only: what produced the original figures
      },
      "records": [                  # one per (op, implementation or peer, shape, dtype, pass)
        {
          "op": "flash_attention",
          "impl": "triton",           # an implementation's name, "default" (the op's own dispatch) or a peer
          "kind": "implementation" | "peer",
          "shape": {"B": 2, "H": 16, "K": 0, "T": 8192, "S": 0, "D": 128, "causal": false},
          "dtype": "bfloat16",
          "pass": "fwd" | "fwd_bwd",
          "metric": "TFLOP/s" | "TB/s",
          "model": "4·B·H·T·S·D, ½ when causal; fwd_bwd 3.5×",   # the FLOP or byte model of the metric
          "status": "ok" | "failed" | "skipped",
          "value": 439.6,             # ok only: work / seconds, in the metric's unit
          "seconds": 0.0025,          # ok only: the core timer's median seconds per call
          "spread": 0.013,            # ok only: the samples' interquartile range over their median
          "error": 0.0023,            # relative error ‖out − ref‖/‖ref‖ against the float32 reference
                                      # (fwd_bwd: over all gradients); null when not finite
          "reason": "...",            # failed / skipped: why
          "date": ..., "device": ..., "fingerprint": ..., "commit": ..., "command": ...   # as in "run"
        }
      ]
    }

A record is timed only after its result passed the check (``error`` within the dtype's tolerance); a
wrong result is ``failed`` with its error, never a figure.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SCHEMA = "ejkernel-bench/1"
PASSES = ("fwd", "fwd_bwd")
STATUSES = ("ok", "failed", "skipped")
_REQUIRED = (
    "op",
    "impl",
    "kind",
    "shape",
    "dtype",
    "pass",
    "metric",
    "model",
    "status",
    "date",
    "device",
    "fingerprint",
    "commit",
    "command",
)


class SchemaError(ValueError):
    pass


def validate(doc: Any) -> None:
    """Raise :class:`SchemaError` naming the first thing in ``doc`` that does not follow the schema."""
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise SchemaError(f"not an {SCHEMA} document (schema: {doc.get('schema') if isinstance(doc, dict) else doc!r})")
    if not isinstance(doc.get("run"), dict) or not isinstance(doc.get("records"), list):
        raise SchemaError("a results document has a 'run' object and a 'records' list")
    for i, r in enumerate(doc["records"]):
        where = f"record {i}"
        if not isinstance(r, dict):
            raise SchemaError(f"{where} is not an object")
        missing = [k for k in _REQUIRED if k not in r]
        if missing:
            raise SchemaError(f"{where} lacks {missing}")
        if r["pass"] not in PASSES or r["status"] not in STATUSES or r["kind"] not in ("implementation", "peer"):
            raise SchemaError(f"{where}: pass {r['pass']!r}, status {r['status']!r}, kind {r['kind']!r}")
        if not isinstance(r["shape"], dict):
            raise SchemaError(f"{where}: shape is not an object")
        if r["status"] == "ok":
            for k in ("value", "seconds"):
                if not isinstance(r.get(k), int | float) or r[k] <= 0:
                    raise SchemaError(f"{where}: an ok record needs a positive {k}, has {r.get(k)!r}")
        elif not isinstance(r.get("reason"), str):
            raise SchemaError(f"{where}: a {r['status']} record needs a reason")


def load(paths: Iterable[str | Path]) -> dict[str, dict[str, Any]]:
    """Results documents by file stem, from files and directories (their ``*.json``), each validated."""
    out: dict[str, dict[str, Any]] = {}
    for p in map(Path, paths):
        for f in sorted(p.glob("*.json")) if p.is_dir() else [p]:
            doc = json.loads(f.read_text())
            try:
                validate(doc)
            except SchemaError as e:
                raise SchemaError(f"{f}: {e}") from None
            out[f.stem] = doc
    return out
