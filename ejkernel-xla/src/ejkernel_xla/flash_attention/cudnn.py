"""cuDNN's fused attention through ``jax.nn.dot_product_attention(implementation="cudnn")``, for NVIDIA GPUs.

It serves the plain and causal cases in half precision, where it is among the fastest kernels
there are; ``supports`` declines everything else so the chain picks another implementation. The call
into cuDNN and the dtype/head-dim checks are those of ``scaled_dot_product_attention``'s cuDNN path
(``ejkernel_xla.scaled_dot_product_attention.cudnn``), which has jax's semantics; this module maps
``flash_attention``'s options onto it.
"""

from __future__ import annotations

from typing import Any

from ejkernel_xla.scaled_dot_product_attention.cudnn import (
    dot_product_attention,
    heuristic_cfg,
    hopper_or_later,
    unsupported_inputs,
)

# The head dims measured on the H200 (BENCHMARKS.md); cuDNN takes 256 only on Hopper and later.
HEAD_DIMS = (64, 128)
HOPPER_HEAD_DIMS = (64, 128, 256)


def supports(inv: Any) -> str | None:
    a = inv.arguments
    q, k, v = a["query"], a["key"], a["value"]
    reason = unsupported_inputs(q, v, HOPPER_HEAD_DIMS if hopper_or_later() else HEAD_DIMS)
    if reason is not None:
        return reason
    for name in ("bias", "attention_mask", "q_segment_ids", "cu_seqlens_q", "sliding_window", "logits_soft_cap"):
        if a.get(name) is not None:
            return f"{name} is not served by the cuDNN path"
    if a.get("dropout_prob", 0.0) > 0:
        return "dropout is not served by the cuDNN path"
    if a.get("causal") and q.shape[1] != k.shape[1]:
        return "causal with T != S (bottom-right alignment) is not served by the cuDNN path"
    if a.get("causal") and q.shape[1] % 2:  # jax 0.11 hands cuDNN the causal mask as a bias: even lengths only
        return f"causal with an odd length (T = S = {q.shape[1]}) is not served by the cuDNN path"
    return None


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
    return dot_product_attention(query, key, value, scale=softmax_scale, is_causal=causal)


__all__ = ["flash_attention", "heuristic_cfg", "supports"]
