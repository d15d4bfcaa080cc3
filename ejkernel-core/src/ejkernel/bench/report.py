"""Tables (markdown) and plots (PNG) from results files, and the generated sections of BENCHMARKS.md.

A generated section sits between ``<!-- bench:begin NAME -->`` and ``<!-- bench:end NAME -->``, NAME being a
results file's stem; :func:`update` rewrites what is between the markers and leaves the prose around.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ejkernel.bench.cases import label


def _fmt(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def _row_key(r: dict[str, Any]) -> tuple[str, str, str]:
    return label(r["shape"]), r["dtype"], r["pass"]


def table(records: list[dict[str, Any]]) -> str:
    """Markdown tables, one per (op, metric): rows = shape, dtype, pass; columns = implementations, then peers."""
    out: list[str] = []
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["op"], r["metric"]), []).append(r)
    for (op, metric), rs in groups.items():
        impls = list(dict.fromkeys(r["impl"] for r in rs if r["kind"] == "implementation"))
        peers = list(dict.fromkeys(r["impl"] for r in rs if r["kind"] == "peer"))
        cols = impls + peers
        rows = list(dict.fromkeys(_row_key(r) for r in rs))
        cell: dict[tuple[tuple[str, str, str], str], dict[str, Any]] = {(_row_key(r), r["impl"]): r for r in rs}
        models = sorted({r["model"] for r in rs})
        out.append(f"`{op}`, {metric} ({'; '.join(models)}); peers marked †:")
        out.append("")
        out.append("| shape | dtype | pass | " + " | ".join(c + (" †" if c in peers else "") for c in cols) + " |")
        out.append("|---|---|---|" + "---:|" * len(cols))
        notes: list[str] = []
        for key in rows:
            cells = []
            for c in cols:
                found = cell.get((key, c))
                if found is None:
                    cells.append("")
                elif found["status"] == "ok":
                    cells.append(_fmt(found["value"]))
                else:
                    cells.append("fails" if found["status"] == "failed" else "—")
                    if found["status"] == "failed":
                        notes.append(f"- {c}, {key[0]} {key[2]}: {found['reason']}")
            out.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells) + " |")
        skipped = sorted({f"- {r['impl']} skipped: {r['reason']}" for r in rs if r["status"] == "skipped"})
        if notes or skipped:
            out.append("")
            out.extend(notes + skipped)
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def provenance(docs: Iterable[dict[str, Any]]) -> str:
    """One line per distinct (date, device, commit, command) of the records: where the figures came from."""
    seen = dict.fromkeys((r["date"], r["device"], r["commit"], r["command"]) for d in docs for r in d["records"])
    lines = [f"- {date}, {device}, commit `{commit}`: `{command}`" for date, device, commit, command in seen]
    sources = dict.fromkeys(d["run"]["source"] for d in docs if d["run"].get("source"))
    lines += [f"- source: {s}" for s in sources]
    return "\n".join(lines) + "\n"


def section(doc: dict[str, Any]) -> str:
    return provenance([doc]) + "\n" + table(doc["records"])


def report(docs: dict[str, dict[str, Any]]) -> str:
    parts = [f"## {name}\n\n{section(doc)}" for name, doc in docs.items()]
    return "\n".join(parts)


_MARKER = re.compile(r"(<!-- bench:begin (?P<name>[^ ]+) -->\n)(?P<body>.*?)(<!-- bench:end (?P=name) -->)", re.S)


def update(text: str, docs: dict[str, dict[str, Any]]) -> str:
    """``text`` with each generated section re-rendered from ``docs[NAME]``; an unknown NAME raises KeyError."""

    def render(m: re.Match[str]) -> str:
        name = m.group("name")
        if name not in docs:
            raise KeyError(f"BENCHMARKS section {name!r} has no results file {name}.json among the inputs")
        return m.group(1) + section(docs[name]) + m.group(4)

    return _MARKER.sub(render, text)


def plots(docs: dict[str, dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """One PNG per (results file, op, pass, dtype, other sizes): the metric against the op's x letter.

    One line per implementation (solid) and peer (dashed). Needs matplotlib (``ejkernel-core[bench]``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ejkernel.bench.cases import CASES

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for name, doc in docs.items():
        groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
        for r in doc["records"]:
            if r["status"] != "ok":
                continue
            x = CASES[r["op"]].x if r["op"] in CASES else "T"
            rest = tuple(sorted((k, v) for k, v in r["shape"].items() if k != x))
            groups.setdefault((r["op"], r["pass"], r["dtype"], r["metric"], x, rest), []).append(r)
        for i, ((op, pass_, dtype, metric, x, rest), rs) in enumerate(groups.items()):
            fig, ax = plt.subplots(figsize=(6, 4))
            for impl in dict.fromkeys(r["impl"] for r in rs):
                pts = sorted((r["shape"].get(x, 0), r["value"]) for r in rs if r["impl"] == impl)
                peer = any(r["kind"] == "peer" for r in rs if r["impl"] == impl)
                ax.plot(*zip(*pts), marker="o", linestyle="--" if peer else "-", label=impl)
            ax.set_xlabel(x)
            ax.set_ylabel(metric)
            ax.set_title(f"{op} {pass_} {dtype} {label(dict(rest))}", fontsize=9)
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
            path = out_dir / f"{name}-{op}-{pass_}-{i}.png"
            fig.savefig(path, dpi=100, bbox_inches="tight")
            plt.close(fig)
            written.append(path)
    return written
