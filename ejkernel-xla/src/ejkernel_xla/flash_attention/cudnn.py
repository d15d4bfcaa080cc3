"""cuDNN's fused attention through ``jax.nn.dot_product_attention(implementation="cudnn")``, for NVIDIA GPUs.

It serves the plain and causal cases in half precision, where it is among the fastest kernels
there are; ``supports`` declines everything else so the chain picks another implementation.
"""

from __future__ import annotations

from typing import Any

import jax

from ejkernel.kernels.params import BwdParams, FwdParams


def supports(inv: Any) -> str | None:
    a = inv.arguments
    q, k, v = a["query"], a["key"], a["value"]
    if str(q.dtype) not in ("bfloat16", "float16"):
        return f"cuDNN attention needs bfloat16 or float16, got {q.dtype}"
    if q.shape[-1] not in (64, 128) or v.shape[-1] != q.shape[-1]:
        return f"cuDNN attention here serves head dims 64 and 128 with Dv == D, got D={q.shape[-1]}, Dv={v.shape[-1]}"
    for name in ("bias", "attention_mask", "q_segment_ids", "cu_seqlens_q", "sliding_window", "logits_soft_cap"):
        if a.get(name) is not None:
            return f"{name} is not served by the cuDNN path"
    if a.get("dropout_prob", 0.0) > 0:
        return "dropout is not served by the cuDNN path"
    if a.get("causal") and q.shape[1] != k.shape[1]:
        return "causal with T != S (bottom-right alignment) is not served by the cuDNN path"
    return None


def heuristic_cfg(inv: Any, stage: str) -> FwdParams | BwdParams:
    return FwdParams() if stage == "fwd" else BwdParams()  # cuDNN picks its own launch parameters


def flash_attention(
    query,
    key,
    value,
    bias=None,
    *,
    attention_mask=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    softmax_scale=None,
    causal=False,
    sliding_window=None,
    logits_soft_cap=None,
    dropout_prob=0.0,
    dropout_seed=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    fwd_params=None,
    bwd_params=None,
):
    """``flash_attention`` on cuDNN (only what ``supports`` admits reaches here)."""
    return jax.nn.dot_product_attention(
        query, key, value, scale=softmax_scale, is_causal=causal, implementation="cudnn"
    )
