"""Plain XLA flash attention: blockwise, O(T) memory forward and backward (see ``_blockwise``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ejkernel.kernels.signatures._attention import normalize_window
from ejkernel.ops.utils.datacarrier import BwdParams, FwdParams

from ejkernel_xla.flash_attention._blockwise import Options, attention, default_blocks

# Around the heuristic (q, kv) blocks: these factors, clipped to the lengths, duplicates dropped.
_CANDIDATE_FACTORS = ((1, 1), (1, 2), (2, 1), (1, 0.5), (0.5, 1), (0.5, 0.5), (2, 2))


def _dims(inv: Any) -> tuple[int, int, int, int]:
    b, t, h, _ = inv.arguments["query"].shape
    return int(b), int(h), int(t), int(inv.arguments["key"].shape[1])


def heuristic_cfg(inv: Any, stage: str) -> FwdParams | BwdParams:
    b, h, t, s = _dims(inv)
    bq, bk = default_blocks(b, h, t, s)
    cls = FwdParams if stage == "fwd" else BwdParams
    return cls(q_blocksize=bq, kv_blocksize=bk)


def candidate_cfgs(inv: Any, stage: str) -> list[FwdParams | BwdParams]:
    b, h, t, s = _dims(inv)
    bq, bk = default_blocks(b, h, t, s)
    cls = FwdParams if stage == "fwd" else BwdParams
    out: list[FwdParams | BwdParams] = []
    for fq, fk in _CANDIDATE_FACTORS:
        cfg = cls(q_blocksize=min(t, max(16, int(bq * fq))), kv_blocksize=min(s, max(16, int(bk * fk))))
        if cfg not in out:
            out.append(cfg)
    return out


def _blocks(params: Any) -> tuple[int | None, int | None]:
    if params is None:
        return (None, None)
    return (params.q_blocksize, params.kv_blocksize)


def flash_attention(
    query, key, value, bias=None, *, attention_mask=None, q_segment_ids=None, kv_segment_ids=None,
    softmax_scale=None, causal=False, sliding_window=None, logits_soft_cap=None, dropout_prob=0.0,
    dropout_seed=None, cu_seqlens_q=None, cu_seqlens_k=None, kv_lengths=None, prefix_lengths=None, fwd_params=None,
    bwd_params=None,
):  # fmt: skip
    """Blockwise flash attention (contract: ``ejkernel.modules.operations.flash_attention``).

    ``fwd_params``/``bwd_params``: ``q_blocksize``/``kv_blocksize`` of the forward and backward
    (None: ``default_blocks``); ``num_warps``/``num_stages`` mean nothing here.
    """
    dropout_prob = float(dropout_prob)
    static_seed = seed = None
    if dropout_prob > 0:
        if dropout_seed is None:
            raise ValueError("flash_attention: dropout_prob > 0 needs dropout_seed (an int or a scalar integer array)")
        if isinstance(dropout_seed, int | np.integer):
            static_seed = int(dropout_seed)  # static: part of the options
        else:
            seed = dropout_seed  # an array, traced like the other inputs
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("flash_attention: pass both q_segment_ids and kv_segment_ids, or neither")
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("flash_attention: pass both cu_seqlens_q and cu_seqlens_k, or neither")
    opts = Options(
        scale=float(query.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale),
        causal=bool(causal),
        window=normalize_window(sliding_window),
        soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        dropout_prob=dropout_prob,
        static_seed=static_seed,
        fwd_blocks=_blocks(fwd_params),
        bwd_blocks=_blocks(bwd_params),
    )
    return attention(opts, query, key, value, bias, attention_mask, q_segment_ids, kv_segment_ids,
                     seed, cu_seqlens_q, cu_seqlens_k, kv_lengths, prefix_lengths)  # fmt: skip


__all__ = ["candidate_cfgs", "flash_attention", "heuristic_cfg"]
