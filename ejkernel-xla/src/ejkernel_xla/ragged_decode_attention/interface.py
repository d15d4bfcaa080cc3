"""XLA ``ragged_decode_attention``: blockwise over the dense cache, only the blocks some row's range touches
(see ``_paged.ragged_dense``).

Launch parameters: ``RaggedDecodeParams`` (``ejkernel_xla.params``): ``keys_per_block``, keys per block (at
most S); ``rows_per_chunk``, batch rows processed together (a chunk; each chunk loops over the blocks its
rows' ranges cover). None: ``heuristic_cfg``. There is no backward (``NoParams``): the op is not
differentiable.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.kernels.signatures._serving import fold_cache_scales, refuse_gradients

from ejkernel_xla._paged import Budget, budget_for, candidate_blocks, choose_blocks, chunk_for, options, ragged_dense
from ejkernel_xla.params import NoParams, RaggedDecodeParams, coerce

OP = "ragged_decode_attention"


def _dims(inv: Any) -> tuple[int, int, int, int, int]:
    b, h, d = inv.arguments["query"].shape
    _, s, kh, _ = inv.arguments["key"].shape
    e = max(int(d), int(inv.arguments["value"].shape[-1]))
    return int(b), int(h), int(kh), e, int(s)


def _blocks(b: int, h: int, kh: int, e: int, s: int, budget: Budget) -> tuple[int, int]:
    return choose_blocks(b, 1, h, kh, e, s, 1, budget)


def heuristic_cfg(inv: Any, stage: str) -> RaggedDecodeParams | NoParams:
    if stage != "fwd":
        return NoParams()  # not differentiable: nothing to tune
    bk, c = _blocks(*_dims(inv), budget_for(inv.backend))
    return RaggedDecodeParams(keys_per_block=bk, rows_per_chunk=c)


def candidate_cfgs(inv: Any, stage: str) -> list[RaggedDecodeParams] | list[NoParams]:
    if stage != "fwd":
        return [NoParams()]
    b, h, kh, e, s = _dims(inv)
    bk, c = _blocks(b, h, kh, e, s, budget_for(inv.backend))
    return [RaggedDecodeParams(keys_per_block=bb, rows_per_chunk=cc) for bb, cc in candidate_blocks(bk, c, b, s, 1)]


def ragged_decode_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    sequence_start: jax.Array,
    sequence_end: jax.Array,
    *,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    k_scale: Any = None,
    v_scale: Any = None,
    fwd_params: RaggedDecodeParams | None = None,
    bwd_params: NoParams | None = None,
) -> jax.Array:
    """Ragged decode attention (contract: ``ejkernel.modules.operations.ragged_decode_attention``)."""
    query, key, value = refuse_gradients(OP, query, key, value)
    query, softmax_scale, finish = fold_cache_scales(query, k_scale, v_scale, softmax_scale)
    b, h, d = query.shape
    s, kh, e = key.shape[1], key.shape[2], max(d, value.shape[-1])
    budget = budget_for(None)
    bk, c = _blocks(b, h, kh, e, s, budget)
    p = coerce(RaggedDecodeParams, fwd_params) or RaggedDecodeParams()
    if p.keys_per_block is not None:
        bk = max(1, min(s, p.keys_per_block))
        c = chunk_for(bk, b, 1, h, kh, e, budget)
    if p.rows_per_chunk is not None:
        c = p.rows_per_chunk
    out = ragged_dense(
        options(d, softmax_scale, logits_soft_cap, sliding_window),
        query,
        key,
        value,
        jnp.asarray(sequence_start),
        jnp.asarray(sequence_end),
        kv_tokens=bk,
        chunk=c,
    )
    return finish(out)


__all__ = ["candidate_cfgs", "heuristic_cfg", "ragged_decode_attention"]
