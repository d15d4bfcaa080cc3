"""Grouped matmul (the mixture-of-experts ``gmm``/``tgmm``, forward and backward) as Triton kernels.

``grouped_matmul`` follows ``ejkernel.modules.operations.grouped_matmul`` exactly; ``supports``,
``heuristic_cfg`` and ``candidate_cfgs`` are the hooks the ejkernel registry and autotuner call;
``GmmFwdParams``/``GmmBwdParams`` its launch parameters.
"""

from __future__ import annotations

from ejkernel_triton.grouped_matmul.interface import (
    GmmBwdParams,
    GmmFwdParams,
    candidate_cfgs,
    grouped_matmul,
    heuristic_cfg,
    supports,
)

__all__ = ["GmmBwdParams", "GmmFwdParams", "candidate_cfgs", "grouped_matmul", "heuristic_cfg", "supports"]
