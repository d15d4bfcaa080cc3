"""Pytest plugin and import hook: the chunked Triton kernels' backward pairs its two state walks in one launch
(``Plan.paired_states``, not yet the default), so that the conformance suites' GPU tier and ``ejkernel bench`` check
and time the pair before it becomes the default. Importing it wraps ``default_plan`` of ``ejkernel_triton.gla.chunk``
and ``ejkernel_triton._simple_chunk`` (every plan of a call derives from it: ``make_plan``, the candidates):

    PYTHONPATH=/tmp/ejk-site:benchmarks/gpucheck python3 -m pytest -p force_pair --ejkernel-tier=gpu \\
        tests/conformance/test_gla.py --ejkernel-platform=triton_chunk
    PYTHONPATH=/tmp/ejk-site:benchmarks/gpucheck python3 -c "import force_pair, sys; from ejkernel.cli import main; \\
        sys.exit(main(sys.argv[1:]))" bench gla --shapes B=2,T=16384,H=16,K=128,V=128 --passes fwd_bwd
"""

from __future__ import annotations

import dataclasses
from types import ModuleType

from ejkernel_triton import _simple_chunk
from ejkernel_triton.gla import chunk


def _pair_backward(module: ModuleType) -> None:
    base = module.default_plan

    def default_plan(d, stage="fwd"):
        return dataclasses.replace(base(d, stage), paired_states=stage == "bwd")

    module.default_plan = default_plan


_pair_backward(chunk)
_pair_backward(_simple_chunk)
