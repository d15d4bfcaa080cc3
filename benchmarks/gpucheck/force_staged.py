"""Pytest plugin and import hook: the chunked Triton kernels' plans take the staged changes that are not yet the
default, so that the conformance suites' GPU tier and ``ejkernel bench`` check and time them before they become the
defaults: the backward pairs its two state walks in one launch (``Plan.paired_states``: ``gla`` and the scalar
decay's ``_simple_chunk``), ``gla``'s forward walks the decayed keys (``Plan.decayed_keys``). Importing it wraps
``default_plan`` of ``ejkernel_triton.gla.chunk`` and ``ejkernel_triton._simple_chunk`` (every plan of a call derives
from it: ``make_plan``, the candidates):

    PYTHONPATH=/tmp/ejk-site:benchmarks/gpucheck python3 -m pytest -p force_staged --ejkernel-tier=gpu \\
        tests/conformance/test_gla.py --ejkernel-platform=triton_chunk
    PYTHONPATH=/tmp/ejk-site python3 benchmarks/gpucheck/force_staged.py bench gla \\
        --shapes B=2,T=16384,H=16,K=128,V=128 --passes fwd_bwd
"""

from __future__ import annotations

import dataclasses
from types import ModuleType

from ejkernel_triton import _simple_chunk
from ejkernel_triton.gla import chunk


def _stage(module: ModuleType, **fwd: bool) -> None:
    base = module.default_plan

    def default_plan(d, stage="fwd"):
        extra = fwd if stage == "fwd" else {}
        return dataclasses.replace(base(d, stage), paired_states=stage == "bwd", **extra)

    module.default_plan = default_plan


_stage(chunk, decayed_keys=True)
_stage(_simple_chunk)


if __name__ == "__main__":  # the ejkernel CLI with the staged plans (staged_bench.sh)
    import sys

    from ejkernel.cli import main

    sys.exit(main(sys.argv[1:]))
