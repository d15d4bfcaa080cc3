"""Compare two dumps of compiled Triton kernels (``EJKERNEL_TRITON_IR_DUMP``, see ``ejkernel_triton.launch``): for a
refactor of kernel code (a helper taken out, a launch's arguments gathered), evidence without a GPU that the GPU
runs the same operations as before.

A kernel pair is *identical*, or has the *same operations* (the same multiset of TTGIR operations with their types
and layouts, SSA names erased, and of PTX instructions, registers and labels erased: the same code in another
order or with other names, as inlining a helper gives), or is *different* (listed with what differs). Debug
locations, source lines and the labels of inlined scopes are left out. It checks no semantics (a swapped operand
reads the same): the interpreter tests do that. Compile with the Triton the GPU machine has (3.6: ``python -m venv
v36 && v36/bin/pip install triton==3.6.0``, this checkout and jax installed beside it) before and after::

    EJKERNEL_TRITON_IR_DUMP=/tmp/before v36/bin/python -m pytest -o addopts= -k compile_for_sm90 tests/triton
    # ... the refactor ...
    EJKERNEL_TRITON_IR_DUMP=/tmp/after v36/bin/python -m pytest -o addopts= -k compile_for_sm90 tests/triton
    python benchmarks/ir_compare.py /tmp/before /tmp/after

Exit status 1 when a kernel differs or one dump has kernels the other has not.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

_SSA = re.compile(r"%[\w#.]+")
_LOC = re.compile(r"\s*loc\((?:[^()]|\([^()]*\))*\)")


def _ttgir(text: str) -> collections.Counter[str]:
    """The operations, SSA names and locations erased."""
    ops: collections.Counter[str] = collections.Counter()
    for line in text.splitlines():
        line = _SSA.sub("%", _LOC.sub("", line)).strip()
        if line and not line.startswith(("#loc", "//")):
            ops[line] += 1
    return ops


def _ptx(text: str) -> collections.Counter[str]:
    """The instructions and branch labels, registers erased; directives, comments, debug sections left out."""
    ops: collections.Counter[str] = collections.Counter()
    for line in text.split(".section\t.debug")[0].splitlines():
        line = line.strip()
        if not line or line.startswith((".", "//")) or re.match(r"\$L__tmp\d+:", line):
            continue
        ops[re.sub(r"\$L__\w+", "L", _SSA.sub("%", line))] += 1
    return ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before")
    ap.add_argument("after")
    a = ap.parse_args()
    before, after = set(os.listdir(a.before)), set(os.listdir(a.after))
    for name in sorted(before ^ after):
        print(f"only in {a.before if name in before else a.after}: {name}")
    counts = collections.Counter[str]()
    for name in sorted(before & after):
        with open(os.path.join(a.before, name)) as f, open(os.path.join(a.after, name)) as g:
            x, y = f.read(), g.read()
        if x == y:
            counts["identical"] += 1
            continue
        ops = _ttgir if name.endswith(".ttgir") else _ptx
        ox, oy = ops(x), ops(y)
        if ox == oy:
            counts["same operations"] += 1
        else:
            counts["different"] += 1
            print(f"{name}: before only {dict((ox - oy).most_common(3))}, after only {dict((oy - ox).most_common(3))}")
    print(", ".join(f"{n} {k}" for k, n in counts.items()) or "no kernels")
    sys.exit(1 if counts["different"] or before ^ after else 0)


if __name__ == "__main__":
    main()
