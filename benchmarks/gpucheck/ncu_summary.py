"""One line per profiled launch of an Nsight Compute ``--csv`` log (``ncu --metrics ... --csv python3 ... > log``):
launch id, kernel name, then the metrics' values in ``--metrics`` order (other lines of the log, the script's own
output, are skipped).

    python3 benchmarks/gpucheck/ncu_summary.py LOG
"""

from __future__ import annotations

import csv
import sys


def summary(path: str) -> list[str]:
    with open(path) as f:
        rows = list(csv.reader(line for line in f if line.startswith('"')))
    if not rows:
        return []
    head, *data = rows
    i_id, i_name, i_metric, i_value = (head.index(c) for c in ("ID", "Kernel Name", "Metric Name", "Metric Value"))
    launches: dict[tuple[int, str], dict[str, str]] = {}
    for row in data:
        launches.setdefault((int(row[i_id]), row[i_name]), {})[row[i_metric]] = row[i_value]
    return [f"{i} {name[:70]} " + " ".join(m.values()) for (i, name), m in launches.items()]


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: ncu_summary.py LOG")
    print("\n".join(summary(sys.argv[1])))
