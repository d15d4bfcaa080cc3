"""Flash attention (forward and backward) as Triton kernels.

``flash_attention`` follows ``ejkernel.modules.operations.flash_attention`` exactly; ``supports``,
``heuristic_cfg`` and ``candidate_cfgs`` are the hooks the ejkernel registry and autotuner call.
"""

from __future__ import annotations

from ejkernel_triton.flash_attention.interface import candidate_cfgs, flash_attention, heuristic_cfg, supports

__all__ = ["candidate_cfgs", "flash_attention", "heuristic_cfg", "supports"]
