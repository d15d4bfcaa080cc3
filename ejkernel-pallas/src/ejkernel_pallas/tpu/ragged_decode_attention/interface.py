"""Mosaic TPU ``ragged_decode_attention`` (contract: ``ejkernel.modules.operations.ragged_decode_attention``).

Serves GQA/MQA, ``softmax_scale``, ``logits_soft_cap`` and ``sliding_window``, in float32 and bfloat16;
declines float16 (``supports``), which the TPU does not compute in. Forward only: differentiating a call
raises the contract's ``TypeError`` (``refuse_gradients``, as every implementation does).

Grid ``(B, key blocks)``: one batch row per step along the first axis, all of its kv heads computed from
the resident ``(bk, K, D)`` block; blocks outside the row's range (and window) are skipped without a fetch.

Launch parameters: ``DecodeKeyParams`` (``ejkernel_pallas.tpu.params``): ``keys_per_block``, keys per block
(default 512), rounded up to a multiple of 8, at most ``S`` and an 8 MiB VMEM budget for the double-buffered
key and value blocks; nothing else (one batch row per step). No backward (``ForwardOnly``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.kernels.signatures._serving import fold_cache_scales, refuse_gradients

from ejkernel_pallas.tpu._paged import DEFAULT_KV_TOKENS, Geometry, interpret_params, max_kv_tokens, round_up
from ejkernel_pallas.tpu._paged import supports as supports
from ejkernel_pallas.tpu.params import DecodeKeyParams, ForwardOnly, coerce
from ejkernel_pallas.tpu.ragged_decode_attention._kernels import forward

OP = "ragged_decode_attention"
_CANDIDATE_TOKENS = (128, 256, 512, 1024, 2048)


def key_block(wanted: int | None, s: int, kv_heads: int, e: int, dtype: Any) -> int:
    """Keys per block: ``wanted`` (default 512) rounded up to a multiple of 8, within ``[1, S]`` and the VMEM budget."""
    tokens = DEFAULT_KV_TOKENS if wanted is None else max(1, int(wanted))
    most = max_kv_tokens(kv_heads, e, dtype) // 8 * 8
    return max(1, min(s, round_up(tokens, 8), most))


def _dims(inv: Any) -> tuple[int, int, int, Any]:
    a = inv.arguments
    _, s, kh, d = a["key"].shape
    return int(s), int(kh), max(int(d), int(a["value"].shape[-1])), np.dtype(a["query"].dtype)


def heuristic_cfg(inv: Any, stage: str) -> DecodeKeyParams | ForwardOnly:
    if stage != "fwd":
        return ForwardOnly()  # not differentiable: nothing to tune
    return DecodeKeyParams(keys_per_block=key_block(None, *_dims(inv)))


def candidate_cfgs(inv: Any, stage: str) -> list[DecodeKeyParams] | list[ForwardOnly]:
    if stage != "fwd":
        return [ForwardOnly()]
    out: list[DecodeKeyParams] = []
    for tokens in _CANDIDATE_TOKENS:
        cfg = DecodeKeyParams(keys_per_block=key_block(tokens, *_dims(inv)))
        if cfg not in out:
            out.append(cfg)
    return out


def _make(interpret: Any) -> Any:
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
        fwd_params: DecodeKeyParams | None = None,
        bwd_params: ForwardOnly | None = None,
    ) -> jax.Array:
        """Mosaic TPU ragged decode attention; launch parameter: ``DecodeKeyParams.keys_per_block``."""
        p = coerce(DecodeKeyParams, fwd_params) or DecodeKeyParams()
        query, key, value = refuse_gradients(OP, query, key, value)
        query, softmax_scale, finish = fold_cache_scales(query, k_scale, v_scale, softmax_scale)
        b, h, d = query.shape
        s, kh = key.shape[1], key.shape[2]
        dv = value.shape[-1]
        if b == 0 or s == 0:  # no row, or no key for any row: zeros
            return jnp.zeros((b, h, dv), query.dtype)
        geo = Geometry(
            rows=1, group=h // kh, kv_heads=kh, bk=key_block(p.keys_per_block, s, kh, max(d, dv), query.dtype),
            pages=0,
            scale=float(d**-0.5 if softmax_scale is None else softmax_scale),
            soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
            window=None if sliding_window is None else int(sliding_window),
        )  # fmt: skip
        run = interpret() if callable(interpret) else interpret
        return finish(forward(geo, query, key, value, jnp.asarray(sequence_start), jnp.asarray(sequence_end), run))

    return ragged_decode_attention


ragged_decode_attention = _make(False)
"""On a TPU: compiled by Mosaic."""
ragged_decode_attention_interpret = _make(interpret_params)
"""On a CPU: the same kernel in JAX's TPU interpret mode (tests; slow)."""

__all__ = [
    "candidate_cfgs",
    "heuristic_cfg",
    "ragged_decode_attention",
    "ragged_decode_attention_interpret",
    "supports",
]
