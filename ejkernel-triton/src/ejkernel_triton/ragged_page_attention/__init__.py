"""``ragged_page_attention`` on the split-K Triton decode kernel (every query row a decode row; see ``interface``).

``ragged_page_attention`` follows ``ejkernel.modules.operations.ragged_page_attention``; ``supports``,
``heuristic_cfg`` and ``candidate_cfgs`` are the hooks the ejkernel registry and autotuner call.
"""

from __future__ import annotations

from ejkernel_triton.ragged_page_attention.interface import (
    candidate_cfgs,
    heuristic_cfg,
    ragged_page_attention,
    supports,
)

__all__ = ["candidate_cfgs", "heuristic_cfg", "ragged_page_attention", "supports"]
