"""``recurrent`` by the fused recurrent Triton kernel (decoding: a few tokens per sequence).

``recurrent`` follows ``ejkernel.modules.operations.recurrent``; ``supports``, ``heuristic_cfg`` and
``candidate_cfgs`` are the hooks the ejkernel registry and autotuner call.
"""

from __future__ import annotations

from ejkernel_triton.recurrent.interface import candidate_cfgs, heuristic_cfg, recurrent, supports

__all__ = ["candidate_cfgs", "heuristic_cfg", "recurrent", "supports"]
