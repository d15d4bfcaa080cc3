"""``ragged_page_attention`` on Triton: decode rows on the split-K kernel, prefill rows in query tiles (see ``interface``).

``ragged_page_attention`` follows ``ejkernel.modules.operations.ragged_page_attention``; ``supports``,
``heuristic_cfg`` and ``candidate_cfgs`` are the hooks the ejkernel registry and autotuner call;
``RaggedPageParams`` are its launch parameters.
"""

from __future__ import annotations

from ejkernel_triton.ragged_page_attention.interface import (
    RaggedPageParams,
    candidate_cfgs,
    heuristic_cfg,
    ragged_page_attention,
    supports,
)

__all__ = ["RaggedPageParams", "candidate_cfgs", "heuristic_cfg", "ragged_page_attention", "supports"]
