"""XLA ``ragged_page_attention``: every live sequence's queries cut into items of ``rows_per_item`` rows,
key blocks gathered page by page for many items at once (see ``_paged``).

Launch parameters: ``RaggedPagedParams`` (``ejkernel_xla.params``): ``rows_per_item``, query rows per item
(a decode sequence fills one row of its item, so small values suit decode-heavy batches and large ones
prefill); ``keys_per_block``, keys per block, rounded down to whole pages (at least one). Items per chunk
follow from both (``choose_blocks``). None: ``heuristic_cfg``. There is no backward (``NoParams``): the op
is not differentiable.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.kernels.signatures._serving import fold_cache_scales, refuse_gradients

from ejkernel_xla._paged import (
    Budget,
    budget_for,
    candidate_blocks,
    choose_blocks,
    chunk_for,
    default_rows,
    options,
    ragged_paged,
)
from ejkernel_xla.params import NoParams, RaggedPagedParams, coerce

OP = "ragged_page_attention"

_ROW_FACTORS = (1, 0.25, 4)


def _items(t: int, s: int, r: int) -> int:
    return max(1, min(t, (t + s * (r - 1)) // r))


def _dims(inv: Any) -> tuple[int, int, int, int, int, int, int]:
    t, h, d = inv.arguments["query"].shape
    _, page, kh, _ = inv.arguments["key_cache"].shape
    e = max(int(d), int(inv.arguments["value_cache"].shape[-1]))
    s, m = inv.arguments["block_tables"].shape
    return int(t), int(s), int(h), int(kh), e, int(page), int(m)


def _plan(t: int, s: int, h: int, kh: int, e: int, page: int, m: int, rows: int | None,
          kv_tokens: int | None, budget: Budget) -> tuple[int, int, int]:  # fmt: skip
    """``(rows per item, key block tokens, items per chunk)``: the given ones, the heuristic for the rest."""
    r = max(1, min(rows or default_rows(t, s), t))
    bk, c = choose_blocks(_items(t, s, r), r, h, kh, e, m * page, page, budget)
    if kv_tokens:
        bk = max(1, min(m, kv_tokens // page)) * page  # whole pages, as paged_items rounds it
        c = chunk_for(bk, _items(t, s, r), r, h, kh, e, budget)
    return r, bk, c


def heuristic_cfg(inv: Any, stage: str) -> RaggedPagedParams | NoParams:
    if stage != "fwd":
        return NoParams()  # not differentiable: nothing to tune
    r, bk, _ = _plan(*_dims(inv), None, None, budget_for(inv.backend))
    return RaggedPagedParams(rows_per_item=r, keys_per_block=bk)


def candidate_cfgs(inv: Any, stage: str) -> list[RaggedPagedParams] | list[NoParams]:
    if stage != "fwd":
        return [NoParams()]
    t, s, h, kh, e, page, m = _dims(inv)
    r0 = default_rows(t, s)
    out: list[RaggedPagedParams] = []
    for fr in _ROW_FACTORS:
        r, bk, c = _plan(t, s, h, kh, e, page, m, max(1, int(r0 * fr)), None, budget_for(inv.backend))
        for bb, _ in candidate_blocks(bk, c, _items(t, s, r), m * page, page)[:3]:  # the key block factors
            cfg = RaggedPagedParams(rows_per_item=r, keys_per_block=bb)
            if cfg not in out:
                out.append(cfg)
    return out


def ragged_page_attention(
    query: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: Any,
    *,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    k_scale: Any = None,
    v_scale: Any = None,
    fwd_params: RaggedPagedParams | None = None,
    bwd_params: NoParams | None = None,
) -> jax.Array:
    """Ragged paged attention (contract: ``ejkernel.modules.operations.ragged_page_attention``)."""
    query, key_cache, value_cache = refuse_gradients(OP, query, key_cache, value_cache)
    query, softmax_scale, finish = fold_cache_scales(query, k_scale, v_scale, softmax_scale)
    t, h, d = query.shape
    _, page, kh, _ = key_cache.shape
    s, m = block_tables.shape
    p = coerce(RaggedPagedParams, fwd_params) or RaggedPagedParams()
    e = max(d, value_cache.shape[-1])
    r, bk, c = _plan(t, s, h, kh, e, page, m, p.rows_per_item, p.keys_per_block, budget_for(None))
    out = ragged_paged(
        options(d, softmax_scale, logits_soft_cap, sliding_window),
        query,
        key_cache,
        value_cache,
        jnp.asarray(kv_lens),
        jnp.asarray(block_tables),
        jnp.asarray(cu_q_lens),
        num_seqs,
        rows=r,
        kv_tokens=bk,
        chunk=c,
    )
    return finish(out)


__all__ = ["candidate_cfgs", "heuristic_cfg", "ragged_page_attention"]
