"""``ring_attention`` for ejkernel-xla: the core's ring schedule (``ejkernel.schedules.ring``).

The ring is written once in the core, on the attention-block contract; each step's block runs through the
core's dispatch, so the fastest installed ``flash_attention_block`` implementation serves it (this plugin's
blockwise kernel, ``ejkernel_xla.flash_attention.block``, where nothing faster is installed; Triton on a GPU).
This plugin registers the schedule as its ``ring_attention`` implementation.
"""

from __future__ import annotations

from ejkernel.schedules.ring import candidate_cfgs, heuristic_cfg, ring_attention

__all__ = ["candidate_cfgs", "heuristic_cfg", "ring_attention"]
