"""``ragged_decode_attention`` as a split-K Triton decode kernel.

``ragged_decode_attention`` follows ``ejkernel.modules.operations.ragged_decode_attention``; ``supports``,
``heuristic_cfg`` and ``candidate_cfgs`` are the hooks the ejkernel registry and autotuner call.
"""

from __future__ import annotations

from ejkernel_triton.ragged_decode_attention.interface import (
    candidate_cfgs,
    heuristic_cfg,
    ragged_decode_attention,
    supports,
)

__all__ = ["candidate_cfgs", "heuristic_cfg", "ragged_decode_attention", "supports"]
