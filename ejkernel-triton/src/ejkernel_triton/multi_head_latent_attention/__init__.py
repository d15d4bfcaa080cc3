"""Triton ``multi_head_latent_attention`` (alias ``flash_mla``) for decoding: split-K over the context, all the
query heads of a sequence against each latent tile loaded once.

``multi_head_latent_attention`` follows ``ejkernel.modules.operations.multi_head_latent_attention``;
``supports``, ``heuristic_cfg`` and ``candidate_cfgs`` are the hooks the ejkernel registry and autotuner call.
"""

from __future__ import annotations

from ejkernel_triton.multi_head_latent_attention.interface import (
    MlaBwdParams,
    MlaDecodeParams,
    candidate_cfgs,
    heuristic_cfg,
    multi_head_latent_attention,
    supports,
)

__all__ = [
    "MlaBwdParams",
    "MlaDecodeParams",
    "candidate_cfgs",
    "heuristic_cfg",
    "multi_head_latent_attention",
    "supports",
]
