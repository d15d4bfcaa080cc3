"""XLA ``page_attention``: one decode query per sequence, key blocks gathered page by page (see ``_paged``).

Launch parameters: ``PagedParams`` (``ejkernel_xla.params``): ``keys_per_block``, keys per block, rounded
down to whole pages (at least one page); ``seqs_per_chunk``, sequences processed together (a chunk;
chunks run one after another, each over the blocks its longest sequence needs, sequences sorted by length
first). None: ``heuristic_cfg``. There is no backward (``NoParams``): the op is not differentiable.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.kernels.signatures._serving import fold_cache_scales, refuse_gradients

from ejkernel_xla._paged import Budget, budget_for, candidate_blocks, choose_blocks, chunk_for, options, paged_items
from ejkernel_xla.params import NoParams, PagedParams, coerce

OP = "page_attention"


def _blocks(n: int, h: int, kh: int, e: int, page: int, m: int, budget: Budget) -> tuple[int, int]:
    return choose_blocks(n, 1, h, kh, e, m * page, page, budget)


def _dims(inv: Any) -> tuple[int, int, int, int, int, int]:
    n, h, d = inv.arguments["query"].shape
    _, page, kh, _ = inv.arguments["key_cache"].shape
    e = max(int(d), int(inv.arguments["value_cache"].shape[-1]))
    return int(n), int(h), int(kh), e, int(page), int(inv.arguments["block_tables"].shape[1])


def heuristic_cfg(inv: Any, stage: str) -> PagedParams | NoParams:
    if stage != "fwd":
        return NoParams()  # not differentiable: nothing to tune
    bk, c = _blocks(*_dims(inv), budget_for(inv.backend))
    return PagedParams(keys_per_block=bk, seqs_per_chunk=c)


def candidate_cfgs(inv: Any, stage: str) -> list[PagedParams] | list[NoParams]:
    if stage != "fwd":
        return [NoParams()]
    n, h, kh, e, page, m = _dims(inv)
    bk, c = _blocks(n, h, kh, e, page, m, budget_for(inv.backend))
    return [PagedParams(keys_per_block=bb, seqs_per_chunk=cc) for bb, cc in candidate_blocks(bk, c, n, m * page, page)]


def page_attention(
    query: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    context_lens: jax.Array,
    block_tables: jax.Array,
    *,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    k_scale: Any = None,
    v_scale: Any = None,
    fwd_params: PagedParams | None = None,
    bwd_params: NoParams | None = None,
) -> jax.Array:
    """Paged decode attention (contract: ``ejkernel.modules.operations.page_attention``)."""
    query, key_cache, value_cache = refuse_gradients(OP, query, key_cache, value_cache)
    query, softmax_scale, finish = fold_cache_scales(query, k_scale, v_scale, softmax_scale)
    n, h, d = query.shape
    _, page, kh, _ = key_cache.shape
    m, e = block_tables.shape[1], max(d, value_cache.shape[-1])
    budget = budget_for(None)
    bk, c = _blocks(n, h, kh, e, page, m, budget)
    p = coerce(PagedParams, fwd_params) or PagedParams()
    if p.keys_per_block is not None:
        bk = max(1, min(m, p.keys_per_block // page)) * page  # whole pages, as paged_items rounds it
        c = chunk_for(bk, n, 1, h, kh, e, budget)
    if p.seqs_per_chunk is not None:
        c = p.seqs_per_chunk
    lens = jnp.asarray(context_lens).astype(jnp.int32)
    out = paged_items(
        options(d, softmax_scale, logits_soft_cap, sliding_window),
        query[:, None],  # one row per sequence, at position L - 1 (-1: an empty sequence, zeros)
        key_cache,
        value_cache,
        jnp.asarray(block_tables),
        lens,
        (lens - 1)[:, None],
        kv_tokens=bk,
        chunk=c,
    )
    return finish(out[:, 0])


__all__ = ["candidate_cfgs", "heuristic_cfg", "page_attention"]
