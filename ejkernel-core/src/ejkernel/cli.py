"""The ``ejkernel`` command: ``info`` (what is installed and what would run), ``cache`` (tuned configs) and
``bench`` (implementations and peers of an op, checked and timed; tables and plots from results files).

Run as ``ejkernel ...`` or ``python -m ejkernel ...``; ``tests/core/test_cli.py`` runs every command.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


def info_document() -> dict[str, Any]:
    """What ``ejkernel info`` reports, as data (``ejkernel info --json`` prints it; its keys are stable):
    ``versions``, ``device``, ``fingerprint``, ``autotune_policy``, ``plugins`` (one record each),
    ``ops`` (op -> its implementations, each with ``runs_here``, and ``preferred``: the runnable one of
    highest priority, which the chain starts from) and ``cache``."""
    import jax

    from ejkernel import __version__
    from ejkernel.kernels import kernel_registry
    from ejkernel.kernels._types import current_backend
    from ejkernel.ops import autotune_policy, device_fingerprint, fingerprint_id
    from ejkernel.ops.config.chain import default_chain
    from ejkernel.plugins import plugin_records

    backend = current_backend()
    fp = device_fingerprint()
    ops: dict[str, Any] = {}
    for op in kernel_registry.algorithms():
        every = kernel_registry.implementations(op, backend="all")
        here = [i for i in every if i.runs_on(backend)]
        ops[op] = {
            "implementations": [
                {
                    "name": i.name,
                    "platform": i.platform,
                    "backend": i.backend,
                    "plugin": i.plugin,
                    "priority": i.priority,
                    "runs_here": i.runs_on(backend),
                }
                for i in every
            ],
            "preferred": max(here, key=lambda i: i.priority).name if here else None,
        }
    plugins = []
    for r in plugin_records():
        record: dict[str, Any] = {
            "name": r.name,
            "status": r.status,
            "distribution": r.distribution,
            "version": r.version,
            "implementations": sum(
                len([i for i in o["implementations"] if i["plugin"] == r.name]) for o in ops.values()
            ),
        }
        if r.info is not None:
            record.update(platforms=list(r.info.platforms), runs_here=r.info.available, reason=r.info.reason)
        if r.error:
            record["error"] = r.error
        plugins.append(record)
    cache = default_chain().persistent
    return {
        "versions": {
            "ejkernel-core": __version__,
            "jax": jax.__version__,
            "jaxlib": _version("jaxlib"),
            "python": sys.version.split()[0],
        },
        "device": {
            "kind": fp["device_kind"],
            "platform": fp["platform"],
            "count": len(jax.devices()),
            "backend": backend,
        },
        "fingerprint": {"id": fingerprint_id(), **fp},
        "autotune_policy": autotune_policy(),
        "plugins": plugins,
        "ops": ops,
        "cache": {"root": str(cache.root), "files": len(cache.files()), "entries": len(cache.entries())},
    }


def cmd_info(args: argparse.Namespace) -> int:
    doc = info_document()
    if args.json:
        print(json.dumps(doc, indent=2, sort_keys=True))
        return 0
    v, dev = doc["versions"], doc["device"]
    fp = {k: val for k, val in doc["fingerprint"].items() if k != "id"}
    out = [
        f"ejkernel-core {v['ejkernel-core']}   jax {v['jax']}   jaxlib {v['jaxlib']}   python {v['python']}",
        f"device: {dev['kind']} ({dev['platform']}, {dev['count']} device(s))   backend: {dev['backend']}",
        f"fingerprint: {doc['fingerprint']['id']}  {json.dumps(fp, sort_keys=True)}",
        f"autotune policy: {doc['autotune_policy']}   (EJKERNEL_AUTOTUNE_POLICY)",
        "",
    ]
    plugins = doc["plugins"]
    out.append("plugins:" if plugins else "plugins: none installed (pip install ejkernel-xla runs everywhere)")
    for r in plugins:
        ver = f"{r['distribution'] or r['name']} {r['version'] or ''}".strip()
        line = f"  {r['name']:<10} {r['status']:<9} {ver}"
        if r["status"] == "loaded":
            n = r["implementations"]
            line += f"   {n} implementation{'' if n == 1 else 's'}"
        if r["status"] == "loaded" and "platforms" in r:
            line += f"   platforms={','.join(r['platforms'])}   runs here: {'yes' if r['runs_here'] else 'no'}"
            if r["reason"]:
                line += f" ({r['reason']})"
        if r.get("error"):
            line += f"   {r['error']}"
        out.append(line)
    out.append("")
    backend, ops = dev["backend"], doc["ops"]
    platforms = sorted({i["platform"] for o in ops.values() for i in o["implementations"]})
    out.append(
        f"ops x platforms: the implementations by name ('*' = runs on this {backend} device; "
        "others name their backend); platform= takes a name or a platform:"
    )
    if platforms:
        cells_of = {
            op: [
                " ".join(
                    ("*" + i["name"]) if i["runs_here"] else f"{i['name']}({i['backend']})"
                    for i in o["implementations"]
                    if i["platform"] == p
                )
                for p in platforms
            ]
            for op, o in ops.items()
        }
        widths = [max([len(p), *(len(cells_of[op][j]) for op in ops)]) + 2 for j, p in enumerate(platforms)]
        width = max(len(op) for op in ops) + 2
        out.append(("  " + "op".ljust(width) + "".join(p.ljust(w) for p, w in zip(platforms, widths))).rstrip())
        for op in ops:
            out.append("  " + op.ljust(width) + "".join(c.ljust(w) for c, w in zip(cells_of[op], widths)).rstrip())
    else:
        out.append("  (no implementations installed)")
    c = doc["cache"]
    out.append("")
    out.append(
        f"config cache: {c['root']}   {c['files']} file(s), {c['entries']} entr{'y' if c['entries'] == 1 else 'ies'}"
    )
    print("\n".join(out))
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    from ejkernel.ops.config.chain import default_chain

    cache = default_chain().persistent
    if args.action == "list":
        entries = cache.entries()
        print(f"config cache: {cache.root}")
        for path, key, entry in entries:
            stage = key.split("|", 1)[0]
            secs = entry.get("seconds")
            timing = f"{secs * 1e3:.3f} ms" if isinstance(secs, int | float) else ""
            print(
                f"  {path.parent.name}/{path.stem} {stage}: {entry.get('impl')} {entry.get('params')} {timing}  "
                f"{entry.get('invocation', '')}"
            )
        print(f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}")
    elif args.action == "clear":
        print(f"removed {cache.clear()} entries from {cache.root}")
        for stray in cache.strays():
            print(f"left alone: {stray} (not a regular file; remove it by hand)", file=sys.stderr)
    elif args.action == "export":
        doc = cache.export()
        text = json.dumps(doc, indent=1, sort_keys=True)
        if args.file == "-":
            print(text)
        else:
            Path(args.file).write_text(text)
            print(f"exported {sum(len(f['entries']) for f in doc['files'])} entries to {args.file}", file=sys.stderr)
    elif args.action == "import":
        import filelock

        try:
            doc = json.loads(sys.stdin.read() if args.file == "-" else Path(args.file).read_text())
            n = cache.import_(doc)
        except (OSError, ValueError, RecursionError, filelock.Timeout) as e:  # nothing was written
            message = " ".join(str(e).split())  # one line, whatever the document held
            print(f"ejkernel cache import: cannot import {args.file}: {message}; nothing changed", file=sys.stderr)
            return 2
        print(f"imported {n} entries into {cache.root}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from ejkernel.bench import report as rep
    from ejkernel.bench.presets import PRESETS
    from ejkernel.bench.schema import load

    if args.report:
        docs = load(args.report)
        if args.plots:
            for png in rep.plots(docs, args.plots):
                print(f"wrote {png}", file=sys.stderr)
        if args.update:
            target = Path(args.update)
            target.write_text(rep.update(target.read_text(), docs))
            print(f"updated {target}", file=sys.stderr)
        text = rep.report(docs)
        if args.out:
            Path(args.out).write_text(text)
            print(f"wrote {args.out}", file=sys.stderr)
        elif not args.update:
            print(text)
        return 0
    if args.presets:
        for name, p in PRESETS.items():
            print(f"{name:16} {p.op:24} {len(p.shapes)} shapes, {','.join(p.passes)}, {p.dtype}: {p.about}")
        return 0
    from ejkernel.bench.cases import CASES
    from ejkernel.bench.run import run, shapes_of

    preset = PRESETS[args.preset] if args.preset else None
    op = args.op or (preset.op if preset else None)
    if op is None:
        print("ejkernel bench: name an op or a --preset (--presets lists them)", file=sys.stderr)
        return 2
    if op not in CASES:
        print(f"ejkernel bench: no benchmark for {op!r}; ops: {', '.join(CASES)}", file=sys.stderr)
        return 2
    if preset is not None and preset.op != op:
        print(f"ejkernel bench: preset {args.preset} is for {preset.op}, not {op}", file=sys.stderr)
        return 2
    texts = args.shapes or (list(preset.shapes) if preset else [""])
    try:
        shapes = shapes_of(op, [t for t in texts if t] or [",".join(f"{k}={v}" for k, v in CASES[op].defaults.items())])
        doc, path = run(
            op,
            shapes,
            impls=args.impls.split(",") if args.impls else None,
            peers=[] if args.peers == "none" else (args.peers.split(",") if args.peers else None),
            dtype=args.dtype or (preset.dtype if preset else "bfloat16"),
            passes=args.passes.split(",") if args.passes else (preset.passes if preset else ("fwd",)),
            out_dir=args.out,
            preset=args.preset,
            budget_s=args.budget_s,
            progress=not args.json,
        )
    except ValueError as e:
        print(f"ejkernel bench: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(doc["records"], indent=1))
    else:
        print(rep.table(doc["records"]))
        if path is not None:
            print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ejkernel", description="ejkernel: what is installed, what runs, tuned configs"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, device, plugins, the op x platform matrix, cache")
    info.add_argument("--json", action="store_true", help="the same as one JSON document (for scripts)")
    info.set_defaults(func=cmd_info)
    cache = sub.add_parser("cache", help="list, clear, export or import tuned configs")
    cache_sub = cache.add_subparsers(dest="action", required=True)
    cache_sub.add_parser("list", help="every tuned config on disk")
    cache_sub.add_parser("clear", help="delete every tuned config")
    for name, what in (
        ("export", "write all tuned configs to FILE (- for stdout)"),
        ("import", "merge tuned configs from FILE (- for stdin)"),
    ):
        p = cache_sub.add_parser(name, help=what)
        p.add_argument("file", metavar="FILE")
    cache.set_defaults(func=cmd_cache)
    bench = sub.add_parser(
        "bench",
        help="time every installed implementation of an op and its peers (checked against the reference first)",
        description="Time OP's installed implementations and peers, or render results files (--report).",
    )
    bench.add_argument("op", nargs="?", help="the op (flash_attention, page_attention, grouped_matmul, ...)")
    bench.add_argument("--shapes", nargs="+", help="B=2,T=8192,causal=1 or the op's shorthand 2x16x8192x128")
    bench.add_argument("--preset", help="a named shape set (--presets lists them)")
    bench.add_argument("--presets", action="store_true", help="list the presets")
    bench.add_argument("--impls", help="implementation names, comma-separated ('default': the op's own dispatch)")
    bench.add_argument("--peers", help="peer names, comma-separated, or 'none' (default: every peer of the op)")
    bench.add_argument("--dtype", help="bfloat16 (default), float16, float32")
    bench.add_argument("--passes", help="fwd,fwd_bwd (default: the preset's, else fwd)")
    bench.add_argument("--budget-s", type=float, default=1.0, help="device seconds of samples per measurement")
    bench.add_argument("--out", help="results directory (a run) or markdown file (--report)")
    bench.add_argument("--json", action="store_true", help="print the records as JSON, no progress bar")
    bench.add_argument("--report", nargs="+", metavar="DIR_OR_FILE", help="render results files instead of running")
    bench.add_argument("--plots", help="with --report: write PNG plots into this directory")
    bench.add_argument("--update", help="with --report: rewrite this file's <!-- bench:begin NAME --> sections")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
