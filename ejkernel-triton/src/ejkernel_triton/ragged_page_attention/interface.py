"""Triton ``ragged_page_attention``, first version: every query row as one decode row of the split-K kernel.

Row ``t`` of live sequence ``s`` is a decode query at position ``i = kv_len - q_len + r`` that attends the keys
``[lo, i + 1)`` (``lo`` from the window) of ``s``'s pages, so the whole ragged batch is one launch of
``ejkernel_triton._decode_kernels.split_kv_decode`` over ``T`` rows, with the block table gathered per row.
Decode rows run at the decode kernel's speed; prefill rows are correct but read their sequence's keys once per
row (through L2), not in flash-style query tiles with causal block skipping: that kernel is still to come, so
this implementation is registered below the XLA one (force it with ``platform="triton"``).

Under ``jit`` (unchecked metadata) page indices are clamped into ``[0, P)`` and positions into the table's
capacity: no value makes the kernel read outside the cache. Launch parameters:
:class:`~ejkernel_triton._decode.PagedDecodeParams`. Not differentiable; no backward (``ForwardOnly``).

Importing this module does not import Triton.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.kernels.params import coerce
from ejkernel.kernels.signatures._serving import refuse_gradients

from ejkernel_triton._decode import ForwardOnly, PagedDecodeParams, arguments, decode, supports_decode
from ejkernel_triton.page_attention.interface import _params, _plan

__all__ = ["candidate_cfgs", "heuristic_cfg", "ragged_page_attention", "supports"]

OP = "ragged_page_attention"


def _dims(inv: Any) -> tuple[int, int, int, int, int, int, int]:
    """(T, KH, max keys, D, Dv, bytes per element, page) of a call."""
    args = arguments(inv)
    q, kc, vc, tables = args["query"], args["key_cache"], args["value_cache"], args["block_tables"]
    page = int(kc.shape[1])
    e = int(np.dtype(q.dtype).itemsize)
    return int(q.shape[0]), int(kc.shape[2]), int(tables.shape[1]) * page, int(q.shape[-1]), int(vc.shape[-1]), e, page


def heuristic_cfg(inv: Any, stage: str = "fwd") -> PagedDecodeParams | ForwardOnly:
    if stage != "fwd":
        return ForwardOnly()  # not differentiable: nothing to tune
    t, kh, keys, d, dv, e, page = _dims(inv)
    return _params(_plan(t, kh, keys, d, dv, e, page, PagedDecodeParams()), page)


def candidate_cfgs(inv: Any, stage: str = "fwd") -> list[PagedDecodeParams] | list[ForwardOnly]:
    from ejkernel_triton.page_attention.interface import candidate_cfgs as paged_candidates

    return paged_candidates(_as_paged(inv), stage)


def _as_paged(inv: Any) -> dict[str, Any]:
    args = arguments(inv)
    return {k: args[k] for k in ("query", "key_cache", "value_cache", "block_tables")}


def supports(inv: Any) -> str | None:
    args = arguments(inv)
    return supports_decode(OP, args["query"], args["key_cache"], args["value_cache"])


def _rows(
    t: int, kv_lens: Any, block_tables: Any, cu_q_lens: Any, num_seqs: Any, capacity: int, window: int | None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per query row: the keys ``[lo, hi)`` it attends (empty for padding) and its sequence's table row."""
    slots = kv_lens.shape[0]
    n = jnp.clip(jnp.asarray(num_seqs, jnp.int32).reshape(-1)[0], 0, slots)
    cu = jnp.asarray(cu_q_lens).astype(jnp.int32)
    cu = cu[jnp.minimum(jnp.arange(slots + 1), n)]  # slots past the live ones hold the last live offset
    rows = jnp.arange(t, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu[1:], rows, side="right").astype(jnp.int32), 0, slots - 1)
    live = rows < cu[n]
    q_len = cu[seq + 1] - cu[seq]
    pos = jnp.asarray(kv_lens).astype(jnp.int32)[seq] - q_len + (rows - cu[seq])
    hi = jnp.where(live, jnp.clip(pos + 1, 0, capacity), 0)
    lo = jnp.zeros_like(hi) if window is None else jnp.maximum(hi - window, 0)
    return lo, hi, jnp.asarray(block_tables).astype(jnp.int32)[seq]


def ragged_page_attention(
    query: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array | int,
    *,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    fwd_params: PagedDecodeParams | None = None,
    bwd_params: ForwardOnly | None = None,
) -> jax.Array:
    """Mixed prefill and decode over a paged cache (contract: ``ejkernel.modules.operations.ragged_page_attention``).

    Shapes: ``query [T, H, D]``, ``key_cache [P, page, K, D]``, ``value_cache [P, page, K, Dv]``, ``kv_lens [S]``,
    ``block_tables [S, M]``, ``cu_q_lens [S+1]``; returns ``[T, H, Dv]`` in ``query``'s dtype."""
    query, key_cache, value_cache = refuse_gradients(OP, query, key_cache, value_cache)
    t, h, d = query.shape
    page, kh = int(key_cache.shape[1]), int(key_cache.shape[2])
    capacity = int(block_tables.shape[1]) * page
    p = coerce(PagedDecodeParams, fwd_params) or PagedDecodeParams()
    plan = _plan(t, kh, capacity, d, int(value_cache.shape[-1]), int(np.dtype(query.dtype).itemsize), page, p)
    window = None if sliding_window is None else int(sliding_window)
    lo, hi, tables = _rows(t, kv_lens, block_tables, cu_q_lens, num_seqs, capacity, window)
    return decode(
        plan,
        query,
        key_cache,
        value_cache,
        lo,
        hi,
        tables,
        page=page,
        scale=float(d**-0.5 if softmax_scale is None else softmax_scale),
        softcap=None if logits_soft_cap is None else float(logits_soft_cap),
    )
