"""Triton ``page_attention``: split-K decode over a paged cache (the kernel: ``ejkernel_triton._decode_kernels``).

Each program takes one (split of the context, kv head, sequence) with all the query heads of that kv head, and
gathers its pages through the block table, ``pages_per_block`` pages per step; the splits merge by log-sum-exp.
Launch parameters: :class:`~ejkernel_triton._decode.PagedDecodeParams` (None fields: :func:`heuristic_cfg`'s).
Not differentiable (the contract's ``TypeError``); there is no backward (``ForwardOnly``).

Under ``jit`` (unchecked metadata) lengths are clamped into ``[0, M * page]`` and table entries into ``[0, P)``,
as the XLA implementation does: no value makes the kernel read outside the cache.

Importing this module does not import Triton.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.kernels.params import coerce
from ejkernel.kernels.signatures._serving import fold_cache_scales, refuse_gradients

from ejkernel_triton._decode import (
    ForwardOnly,
    PagedDecodeParams,
    Plan,
    arguments,
    candidate_plans,
    decode,
    make_plan,
    supports_decode,
)

__all__ = ["candidate_cfgs", "heuristic_cfg", "page_attention", "supports"]

OP = "page_attention"


def _dims(inv: Any) -> tuple[int, int, int, int, int, int, int]:
    """(N, KH, max keys, D, Dv, bytes per cache element, page) of a call."""
    args = arguments(inv)
    q, kc, vc, tables = args["query"], args["key_cache"], args["value_cache"], args["block_tables"]
    page = int(kc.shape[1])
    e = int(np.dtype(kc.dtype).itemsize)
    return int(q.shape[0]), int(kc.shape[2]), int(tables.shape[1]) * page, int(q.shape[-1]), int(vc.shape[-1]), e, page


def _pages_per_block(block_n: int, page: int) -> int:
    return max(1, block_n // page)


def _block_n(pages_per_block: int, page: int) -> int:
    """Keys per step: whole pages, at least 16 (the tensor cores' smallest tile), a power of two."""
    n = max(16, pages_per_block * page)
    return 1 << (n - 1).bit_length()


def _params(plan: Plan, page: int) -> PagedDecodeParams:
    return PagedDecodeParams(
        num_splits=plan.splits,
        pages_per_block=_pages_per_block(plan.block_n, page),
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )


def _plan(n: int, kh: int, keys: int, d: int, dv: int, e: int, page: int, p: PagedDecodeParams) -> Plan:
    """The launch of a call: ``p``'s fields, the others the heuristic's (whose step is rounded to whole pages)."""
    ppb = p.pages_per_block
    if ppb is None:
        default = make_plan(n, kh, keys, d, dv, e, splits=1, block_n=None, num_warps=None, num_stages=None)
        ppb = _pages_per_block(default.block_n, page)
    return make_plan(
        n,
        kh,
        keys,
        d,
        dv,
        e,
        splits=p.num_splits or None,
        block_n=_block_n(ppb, page),
        num_warps=p.num_warps,
        num_stages=p.num_stages,
    )


def heuristic_cfg(inv: Any, stage: str = "fwd") -> PagedDecodeParams | ForwardOnly:
    if stage != "fwd":
        return ForwardOnly()  # not differentiable: nothing to tune
    n, kh, keys, d, dv, e, page = _dims(inv)
    return _params(_plan(n, kh, keys, d, dv, e, page, PagedDecodeParams()), page)


def candidate_cfgs(inv: Any, stage: str = "fwd") -> list[PagedDecodeParams] | list[ForwardOnly]:
    if stage != "fwd":
        return [ForwardOnly()]
    n, kh, keys, d, dv, e, page = _dims(inv)
    out = [_params(p, page) for p in candidate_plans(n, kh, keys, d, dv, e)]
    return list(dict.fromkeys(out))  # pages round the same step sizes together for large pages


def supports(inv: Any) -> str | None:
    args = arguments(inv)
    return supports_decode(OP, args["query"], args["key_cache"], args["value_cache"])


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
    fwd_params: PagedDecodeParams | None = None,
    bwd_params: ForwardOnly | None = None,
) -> jax.Array:
    """Paged decode attention (contract: ``ejkernel.modules.operations.page_attention``) on Triton.

    Shapes: ``query [N, H, D]``, ``key_cache [P, page, K, D]``, ``value_cache [P, page, K, Dv]``,
    ``context_lens [N]``, ``block_tables [N, M]``; returns ``[N, H, Dv]`` in ``query``'s dtype."""
    query, key_cache, value_cache = refuse_gradients(OP, query, key_cache, value_cache)
    query, softmax_scale, finish = fold_cache_scales(query, k_scale, v_scale, softmax_scale)
    n, h, d = query.shape
    page, kh = int(key_cache.shape[1]), int(key_cache.shape[2])
    m = int(block_tables.shape[1])
    p = coerce(PagedDecodeParams, fwd_params) or PagedDecodeParams()
    plan = _plan(n, kh, m * page, d, int(value_cache.shape[-1]), int(np.dtype(key_cache.dtype).itemsize), page, p)
    hi = jnp.clip(jnp.asarray(context_lens).astype(jnp.int32), 0, m * page)
    lo = jnp.zeros_like(hi) if sliding_window is None else jnp.maximum(hi - int(sliding_window), 0)
    out = decode(
        plan,
        query,
        key_cache,
        value_cache,
        lo,
        hi,
        jnp.asarray(block_tables).astype(jnp.int32),
        page=page,
        scale=float(d**-0.5 if softmax_scale is None else softmax_scale),
        softcap=None if logits_soft_cap is None else float(logits_soft_cap),
    )
    return finish(out)
