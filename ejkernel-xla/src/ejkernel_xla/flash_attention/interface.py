"""Plain XLA flash attention (interim: dense scores; the blockwise version replaces it)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.kernels.signatures.flash_attention import dropout_keep, normalize_window
from ejkernel.ops.utils.datacarrier import BwdParams, FwdParams


def heuristic_cfg(inv: Any, stage: str) -> FwdParams | BwdParams:
    return FwdParams() if stage == "fwd" else BwdParams()


def candidate_cfgs(inv: Any, stage: str) -> list[FwdParams | BwdParams]:
    return [heuristic_cfg(inv, stage)]


def flash_attention(
    query, key, value, bias=None, *, attention_mask=None, q_segment_ids=None, kv_segment_ids=None,
    softmax_scale=None, causal=False, sliding_window=None, logits_soft_cap=None, dropout_prob=0.0,
    dropout_seed=None, cu_seqlens_q=None, cu_seqlens_k=None, fwd_params=None, bwd_params=None,
):
    b, t, h, d = query.shape
    s, kh = key.shape[1], key.shape[2]
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    qg = query.reshape(b, t, kh, h // kh, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, key, preferred_element_type=jnp.float32) * scale
    scores = scores.reshape(b, h, t, s)
    if bias is not None:
        scores = scores + bias.astype(jnp.float32)
    if logits_soft_cap is not None:
        scores = logits_soft_cap * jnp.tanh(scores / logits_soft_cap)
    i = jnp.arange(t)[:, None]
    j = jnp.arange(s)[None, :]
    if cu_seqlens_q is not None:
        seq_q = jnp.searchsorted(cu_seqlens_q, jnp.arange(t), side="right") - 1
        seq_k = jnp.searchsorted(cu_seqlens_k, jnp.arange(s), side="right") - 1
        n = cu_seqlens_q.shape[0] - 1
        sq = jnp.clip(seq_q, 0, n - 1)
        allowed = (seq_q[:, None] == seq_k[None, :]) & (seq_q[:, None] < n)
        offset = ((cu_seqlens_k[sq + 1] - cu_seqlens_k[sq]) - (cu_seqlens_q[sq + 1] - cu_seqlens_q[sq]))[:, None]
        i = (i[:, 0] - cu_seqlens_q[sq])[:, None]
        j = j - cu_seqlens_k[sq][:, None]
    else:
        allowed = jnp.ones((t, s), bool)
        offset = s - t
    if causal:
        allowed &= j <= i + offset
    window = normalize_window(sliding_window)
    if window is not None:
        allowed &= (j >= i + offset - window[0]) & (j <= i + offset + window[1])
    allowed = allowed[None, None]
    if attention_mask is not None:
        allowed = allowed & attention_mask
    if q_segment_ids is not None:
        allowed = allowed & (q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :])
    scores = jnp.where(allowed, scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.exp(scores - jnp.where(jnp.isfinite(m), m, 0.0))
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    if dropout_prob > 0:
        bi, hi, ti, si = (jnp.arange(n).reshape([-1 if a == ax else 1 for a in range(4)]) for ax, n in enumerate((b, h, t, s)))
        p = jnp.where(dropout_keep(dropout_seed, bi, hi, ti, si, h, dropout_prob, xp=jnp), p / (1 - dropout_prob), 0.0)
    p = p.reshape(b, kh, h // kh, t, s).astype(value.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", p, value, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, -1).astype(query.dtype)
