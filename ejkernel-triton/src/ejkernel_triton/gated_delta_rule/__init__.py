"""``gated_delta_rule`` as a fused recurrent Triton kernel (decoding: a few tokens per sequence).

``gated_delta_rule`` follows ``ejkernel.modules.operations.gated_delta_rule``; ``supports``, ``heuristic_cfg`` and
``candidate_cfgs`` are the hooks the ejkernel registry and autotuner call.
"""

from __future__ import annotations

from ejkernel_triton.gated_delta_rule.interface import candidate_cfgs, gated_delta_rule, heuristic_cfg, supports

__all__ = ["candidate_cfgs", "gated_delta_rule", "heuristic_cfg", "supports"]
