"""One line per profiled launch of an Nsight Compute ``--csv`` log (``ncu --metrics ... --csv python3 ... > log``):
launch id, kernel name, then the metrics' values in ``--metrics`` order. With ``--per N``, launches are labelled
by the script's own ``config ...`` lines in the same log, in order, ``N`` launches each (a sweep that runs every
config the same way, e.g. ``gla_intra_warps.py``: 4, ``gdr_fwd_sweep.py``: 6).

    python3 benchmarks/gpucheck/ncu_summary.py LOG [--per N]
"""

from __future__ import annotations

import csv
import sys


def summary(path: str, per: int = 0) -> list[str]:
    with open(path) as f:
        lines = f.read().splitlines()
    rows = list(csv.reader(line for line in lines if line.startswith('"')))
    labels = [line.removeprefix("config ").strip() for line in lines if line.startswith("config ")]
    if not rows:
        return []
    head, *data = rows
    i_id, i_name, i_metric, i_value = (head.index(c) for c in ("ID", "Kernel Name", "Metric Name", "Metric Value"))
    launches: dict[tuple[int, str], dict[str, str]] = {}
    for row in data:
        launches.setdefault((int(row[i_id]), row[i_name]), {})[row[i_metric]] = row[i_value]
    out = []
    for n, ((i, name), m) in enumerate(launches.items()):
        label = ""
        if per:
            label = (labels[n // per] if n // per < len(labels) else "?") + " | "
        out.append(f"{label}{i} {name[:70]} " + " ".join(m.values()))
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    per = 0
    if "--per" in args:
        per = int(args.pop(args.index("--per") + 1))
        args.remove("--per")
    if len(args) != 1 or per < 0:
        sys.exit("usage: ncu_summary.py LOG [--per N]")
    print("\n".join(summary(args[0], per)))
