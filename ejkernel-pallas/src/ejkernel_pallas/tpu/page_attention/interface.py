"""Mosaic TPU ``page_attention`` (contract: ``ejkernel.modules.operations.page_attention``).

Serves GQA/MQA, ``softmax_scale``, ``logits_soft_cap`` and ``sliding_window``, in float32 and bfloat16;
declines float16 (``supports``), which the TPU does not compute in. Forward only: differentiating a call
raises the contract's ``TypeError`` (``refuse_gradients``, as every implementation does).

Grid ``(N, key blocks)``: one sequence per step along the first axis, all of its kv heads computed from
the pages resident in VMEM (see ``ejkernel_pallas.tpu._paged`` for why whole pages), blocks past the
length or before the window skipped without a fetch.

Launch parameters: ``PagedKeyParams`` (``ejkernel_pallas.tpu.params``): ``keys_per_block``, keys per block,
rounded down to whole pages (at least one page, at most 16 pages, the table's width and an 8 MiB VMEM
budget for the double-buffered pages); nothing else (one sequence per step). No backward (``ForwardOnly``).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ejkernel.kernels.signatures._serving import fold_cache_scales, refuse_gradients

from ejkernel_pallas.tpu._paged import Geometry, candidate_pages, interpret_params, pages_per_block
from ejkernel_pallas.tpu._paged import supports as supports
from ejkernel_pallas.tpu.page_attention._kernels import forward
from ejkernel_pallas.tpu.params import ForwardOnly, PagedKeyParams, coerce

OP = "page_attention"


def _dims(inv: Any) -> tuple[int, int, int, int, Any]:
    a = inv.arguments
    _, page, kh, d = a["key_cache"].shape
    e = max(int(d), int(a["value_cache"].shape[-1]))
    return int(page), int(a["block_tables"].shape[1]), int(kh), e, np.dtype(a["query"].dtype)


def heuristic_cfg(inv: Any, stage: str) -> PagedKeyParams | ForwardOnly:
    if stage != "fwd":
        return ForwardOnly()  # not differentiable: nothing to tune
    page, m, kh, e, dtype = _dims(inv)
    return PagedKeyParams(keys_per_block=pages_per_block(None, page, m, kh, e, dtype) * page)


def candidate_cfgs(inv: Any, stage: str) -> list[PagedKeyParams] | list[ForwardOnly]:
    if stage != "fwd":
        return [ForwardOnly()]
    page, m, kh, e, dtype = _dims(inv)
    return [PagedKeyParams(keys_per_block=ppb * page) for ppb in candidate_pages(page, m, kh, e, dtype)]


def _make(interpret: Any) -> Any:
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
        fwd_params: PagedKeyParams | None = None,
        bwd_params: ForwardOnly | None = None,
    ) -> jax.Array:
        """Mosaic TPU paged decode attention; launch parameter: ``PagedKeyParams.keys_per_block`` (whole pages)."""
        p = coerce(PagedKeyParams, fwd_params) or PagedKeyParams()
        query, key_cache, value_cache = refuse_gradients(OP, query, key_cache, value_cache)
        query, softmax_scale, finish = fold_cache_scales(query, k_scale, v_scale, softmax_scale)
        n, h, d = query.shape
        _, page, kh, _ = key_cache.shape
        dv = value_cache.shape[-1]
        m = block_tables.shape[1]
        if n == 0:
            return jax.numpy.zeros((0, h, dv), query.dtype)
        ppb = pages_per_block(p.keys_per_block, page, m, kh, max(d, dv), query.dtype)
        geo = Geometry(
            rows=1, group=h // kh, kv_heads=kh, bk=ppb * page, pages=ppb,
            scale=float(d**-0.5 if softmax_scale is None else softmax_scale),
            soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
            window=None if sliding_window is None else int(sliding_window),
        )  # fmt: skip
        run = interpret() if callable(interpret) else interpret
        return finish(forward(geo, query, key_cache, value_cache, context_lens, block_tables, run))

    return page_attention


page_attention = _make(False)
"""On a TPU: compiled by Mosaic."""
page_attention_interpret = _make(interpret_params)
"""On a CPU: the same kernel in JAX's TPU interpret mode (tests; slow)."""

__all__ = ["candidate_cfgs", "heuristic_cfg", "page_attention", "page_attention_interpret", "supports"]
