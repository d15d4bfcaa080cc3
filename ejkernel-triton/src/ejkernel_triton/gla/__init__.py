"""``gla`` as a fused recurrent Triton kernel (decoding: a few tokens per sequence).

``gla`` follows ``ejkernel.modules.operations.gla``; ``supports``, ``heuristic_cfg`` and ``candidate_cfgs`` are
the hooks the ejkernel registry and autotuner call.
"""

from __future__ import annotations

from ejkernel_triton.gla.interface import candidate_cfgs, gla, heuristic_cfg, supports

__all__ = ["candidate_cfgs", "gla", "heuristic_cfg", "supports"]
