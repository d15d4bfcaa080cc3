"""Mosaic TPU ``ragged_page_attention`` (contract: ``ejkernel.modules.operations.ragged_page_attention``).

Serves mixed prefill and decode batches (causal within every sequence), GQA/MQA, ``softmax_scale``,
``logits_soft_cap`` and ``sliding_window``, in float32 and bfloat16; declines float16 (``supports``), which
the TPU does not compute in. Forward only: differentiating a call raises the contract's ``TypeError``
(``refuse_gradients``, as every implementation does).

Grid ``(work items, key blocks)``: an item is up to ``R`` query rows of one sequence (see ``_kernels``); its
``[K, R * G, D]`` query tile meets the whole pages of each key block (see ``ejkernel_pallas.tpu._paged``),
blocks past its last row's position or before its first row's window skipped without a fetch.

Launch parameters: ``RaggedItemParams`` (``ejkernel_pallas.tpu.params``): ``rows_per_item``, ``R``, query rows
per item (default: a power of two near the mean query length, up to 128: 1 for a decode batch; at most
what a 4 MiB VMEM budget for the query tile, output and float32 accumulator allows); ``keys_per_block``,
keys per block, rounded down to whole pages (at least one page, at most 16 pages, the table's width and an
8 MiB VMEM budget for the double-buffered pages). No backward (``ForwardOnly``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.kernels.signatures._serving import fold_cache_scales, refuse_gradients

from ejkernel_pallas.tpu._paged import (
    Q_VMEM_BYTES,
    Geometry,
    candidate_pages,
    interpret_params,
    pages_per_block,
    round_up,
)
from ejkernel_pallas.tpu._paged import supports as supports
from ejkernel_pallas.tpu.params import ForwardOnly, RaggedItemParams, coerce
from ejkernel_pallas.tpu.ragged_page_attention._kernels import forward

OP = "ragged_page_attention"
_ROW_FACTORS = (1, 0.25, 4)


def rows_per_item(wanted: int | None, t: int, s: int, h: int, e: int, dtype: Any) -> int:
    """``R``: ``wanted`` or a power of two near the mean query length ``T / S`` (up to 128), at most ``T`` and
    the rows whose query tile and output (double-buffered) and float32 accumulator fit ``Q_VMEM_BYTES``."""
    if wanted is None:
        wanted = 1
        while wanted * 2 <= t / max(s, 1) and wanted < 128:
            wanted *= 2
    itemsize = jnp.dtype(dtype).itemsize
    row_bytes = h * round_up(e, 128) * (4 * itemsize + 4)
    return max(1, min(int(wanted), t, max(1, Q_VMEM_BYTES // row_bytes)))


def _dims(inv: Any) -> tuple[int, int, int, int, int, int, int, Any]:
    a = inv.arguments
    t, h, d = a["query"].shape
    _, page, kh, _ = a["key_cache"].shape
    s, m = a["block_tables"].shape
    e = max(int(d), int(a["value_cache"].shape[-1]))
    return int(t), int(s), int(h), int(kh), e, int(page), int(m), np.dtype(a["query"].dtype)


def heuristic_cfg(inv: Any, stage: str) -> RaggedItemParams | ForwardOnly:
    if stage != "fwd":
        return ForwardOnly()  # not differentiable: nothing to tune
    t, s, h, kh, e, page, m, dtype = _dims(inv)
    return RaggedItemParams(
        rows_per_item=rows_per_item(None, t, s, h, e, dtype),
        keys_per_block=pages_per_block(None, page, m, kh, e, dtype) * page,
    )


def candidate_cfgs(inv: Any, stage: str) -> list[RaggedItemParams] | list[ForwardOnly]:
    if stage != "fwd":
        return [ForwardOnly()]
    t, s, h, kh, e, page, m, dtype = _dims(inv)
    r0 = rows_per_item(None, t, s, h, e, dtype)
    out: list[RaggedItemParams] = []
    for factor in _ROW_FACTORS:
        r = rows_per_item(max(1, int(r0 * factor)), t, s, h, e, dtype)
        for ppb in candidate_pages(page, m, kh, e, dtype):
            cfg = RaggedItemParams(rows_per_item=r, keys_per_block=ppb * page)
            if cfg not in out:
                out.append(cfg)
    return out


def _make(interpret: Any) -> Any:
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
        fwd_params: RaggedItemParams | None = None,
        bwd_params: ForwardOnly | None = None,
    ) -> jax.Array:
        """Mosaic TPU ragged paged attention; launch parameters ``RaggedItemParams``: ``rows_per_item`` and
        ``keys_per_block`` (whole pages)."""
        p = coerce(RaggedItemParams, fwd_params) or RaggedItemParams()
        query, key_cache, value_cache = refuse_gradients(OP, query, key_cache, value_cache)
        query, softmax_scale, finish = fold_cache_scales(query, k_scale, v_scale, softmax_scale)
        t, h, d = query.shape
        _, page, kh, _ = key_cache.shape
        s, m = block_tables.shape
        dv = value_cache.shape[-1]
        if t == 0:
            return jnp.zeros((0, h, dv), query.dtype)
        e = max(d, dv)
        ppb = pages_per_block(p.keys_per_block, page, m, kh, e, query.dtype)
        geo = Geometry(
            rows=rows_per_item(p.rows_per_item, t, s, h, e, query.dtype), group=h // kh, kv_heads=kh,
            bk=ppb * page, pages=ppb, scale=float(d**-0.5 if softmax_scale is None else softmax_scale),
            soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
            window=None if sliding_window is None else int(sliding_window),
        )  # fmt: skip
        run = interpret() if callable(interpret) else interpret
        out = forward(
            geo, query, key_cache, value_cache, jnp.asarray(kv_lens), jnp.asarray(block_tables),
            jnp.asarray(cu_q_lens), num_seqs, run,
        )  # fmt: skip
        return finish(out)

    return ragged_page_attention


ragged_page_attention = _make(False)
"""On a TPU: compiled by Mosaic."""
ragged_page_attention_interpret = _make(interpret_params)
"""On a CPU: the same kernel in JAX's TPU interpret mode (tests; slow)."""

__all__ = [
    "candidate_cfgs",
    "heuristic_cfg",
    "ragged_page_attention",
    "ragged_page_attention_interpret",
    "supports",
]
