"""Triton ``ragged_decode_attention``: split-K decode over a dense cache with ragged ranges (the kernel:
``ejkernel_triton._decode_kernels``, the same as ``page_attention``'s, reading row ``b * S + j`` for key ``j``).

Each program takes one (split of the row's range, kv head, batch row) with all the query heads of that kv head;
the splits merge by log-sum-exp. Launch parameters: :class:`~ejkernel_triton._decode.DenseDecodeParams` (None
fields: :func:`heuristic_cfg`'s). Not differentiable (the contract's ``TypeError``); no backward (``ForwardOnly``).

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
    DenseDecodeParams,
    ForwardOnly,
    Plan,
    arguments,
    candidate_plans,
    decode,
    make_plan,
    supports_decode,
)

__all__ = ["candidate_cfgs", "heuristic_cfg", "ragged_decode_attention", "supports"]

OP = "ragged_decode_attention"


def _dims(inv: Any) -> tuple[int, int, int, int, int, int]:
    """(B, KH, S, D, Dv, bytes per cache element) of a call."""
    args = arguments(inv)
    q, k, v = args["query"], args["key"], args["value"]
    e = int(np.dtype(k.dtype).itemsize)
    return int(q.shape[0]), int(k.shape[2]), int(k.shape[1]), int(q.shape[-1]), int(v.shape[-1]), e


def _params(plan: Plan) -> DenseDecodeParams:
    return DenseDecodeParams(
        num_splits=plan.splits, keys_per_block=plan.block_n, num_warps=plan.num_warps, num_stages=plan.num_stages
    )


def heuristic_cfg(inv: Any, stage: str = "fwd") -> DenseDecodeParams | ForwardOnly:
    if stage != "fwd":
        return ForwardOnly()  # not differentiable: nothing to tune
    return _params(make_plan(*_dims(inv), splits=None, block_n=None, num_warps=None, num_stages=None))


def candidate_cfgs(inv: Any, stage: str = "fwd") -> list[DenseDecodeParams] | list[ForwardOnly]:
    if stage != "fwd":
        return [ForwardOnly()]
    return [_params(p) for p in candidate_plans(*_dims(inv))]


def supports(inv: Any) -> str | None:
    args = arguments(inv)
    return supports_decode(OP, args["query"], args["key"], args["value"])


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
    fwd_params: DenseDecodeParams | None = None,
    bwd_params: ForwardOnly | None = None,
) -> jax.Array:
    """Ragged decode attention (contract: ``ejkernel.modules.operations.ragged_decode_attention``) on Triton.

    Shapes: ``query [B, H, D]``, ``key [B, S, K, D]``, ``value [B, S, K, Dv]``, ``sequence_start``/
    ``sequence_end [B]``; returns ``[B, H, Dv]`` in ``query``'s dtype."""
    query, key, value = refuse_gradients(OP, query, key, value)
    query, softmax_scale, finish = fold_cache_scales(query, k_scale, v_scale, softmax_scale)
    b, h, d = query.shape
    s, kh = int(key.shape[1]), int(key.shape[2])
    p = coerce(DenseDecodeParams, fwd_params) or DenseDecodeParams()
    plan = make_plan(
        b,
        kh,
        s,
        d,
        int(value.shape[-1]),
        int(np.dtype(key.dtype).itemsize),
        splits=p.num_splits or None,
        block_n=p.keys_per_block,
        num_warps=p.num_warps,
        num_stages=p.num_stages,
    )
    lo = jnp.clip(jnp.asarray(sequence_start).astype(jnp.int32), 0, s)
    hi = jnp.maximum(jnp.clip(jnp.asarray(sequence_end).astype(jnp.int32), 0, s), lo)
    if sliding_window is not None:
        lo = jnp.maximum(lo, hi - int(sliding_window))
    out = decode(
        plan,
        query,
        key,
        value,
        lo,
        hi,
        None,
        page=1,
        scale=float(d**-0.5 if softmax_scale is None else softmax_scale),
        softcap=None if logits_soft_cap is None else float(logits_soft_cap),
    )
    return finish(out)
