"""``page_attention`` as a split-K Triton decode kernel.

``page_attention`` follows ``ejkernel.modules.operations.page_attention``; ``supports``, ``heuristic_cfg`` and
``candidate_cfgs`` are the hooks the ejkernel registry and autotuner call.
"""

from __future__ import annotations

from ejkernel_triton.page_attention.interface import candidate_cfgs, heuristic_cfg, page_attention, supports

__all__ = ["candidate_cfgs", "heuristic_cfg", "page_attention", "supports"]
