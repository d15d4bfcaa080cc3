"""``lightning_attn`` by the fused recurrent Triton kernel (decoding: a few tokens per sequence).

``lightning_attn`` follows ``ejkernel.modules.operations.lightning_attn``; ``supports``, ``heuristic_cfg`` and
``candidate_cfgs`` are the hooks the ejkernel registry and autotuner call.
"""

from __future__ import annotations

from ejkernel_triton.lightning_attn.interface import candidate_cfgs, heuristic_cfg, lightning_attn, supports

__all__ = ["candidate_cfgs", "heuristic_cfg", "lightning_attn", "supports"]
