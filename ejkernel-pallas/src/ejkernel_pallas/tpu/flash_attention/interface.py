"""Mosaic TPU ``flash_attention`` (contract: ``ejkernel.modules.operations.flash_attention``).

Serves causal (bottom-right aligned), sliding window, soft cap, bias (differentiable, broadcastable
over batch and heads), segment ids, GQA/MQA and any ``softmax_scale``, in float32 and bfloat16.
It declines (``supports``) float16, ``attention_mask``, dropout and varlen packing (``cu_seqlens``).

The backward keeps ``(out, lse)`` only and recomputes probabilities tile by tile: dK/dV in one
kernel (per query head, summed over each group afterwards), dQ and dBias in another.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from ejkernel.device import round_up
from ejkernel.kernels.signatures._attention import normalize_window
from ejkernel.ops.utils.datacarrier import BwdParams, FwdParams

from ejkernel_pallas.tpu.flash_attention._kernels import Geometry, backward, forward

SUPPORTED_DTYPES = ("float32", "bfloat16")
# Blocks are multiples of 128 (the lane width) so every block spec tiles the TPU's (8, 128) layout.
_BLOCKS = (128, 256, 512)


def supports(inv: Any) -> str | None:
    """``None`` when this kernel serves ``inv``, else the reason it does not."""
    a = inv.arguments
    dtype = str(np.dtype(a["query"].dtype))
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} (Mosaic TPU kernels take float32 or bfloat16)"
    for name, why in (
        ("attention_mask", "an arbitrary attention_mask (use segment ids, causal or a window)"),
        ("cu_seqlens_q", "varlen packing (cu_seqlens_q/cu_seqlens_k)"),
    ):
        if a.get(name) is not None:
            return why
    if a.get("dropout_prob", 0.0):
        return "dropout"
    return None


def _block(n: int, wanted: int | None) -> int:
    """The block for a length ``n``: ``wanted`` (default 128 below 1024, else 512), at most ``n`` rounded up to 128."""
    if wanted is None:
        wanted = 128 if n < 1024 else 512
    return min(round_up(max(int(wanted), 128), 128), round_up(n, 128))


def heuristic_cfg(inv: Any, stage: str) -> FwdParams | BwdParams:
    t, s = int(inv.arguments["query"].shape[1]), int(inv.arguments["key"].shape[1])
    cls = FwdParams if stage == "fwd" else BwdParams
    return cls(q_blocksize=_block(t, None), kv_blocksize=_block(s, None))


def candidate_cfgs(inv: Any, stage: str) -> list[FwdParams | BwdParams]:
    t, s = int(inv.arguments["query"].shape[1]), int(inv.arguments["key"].shape[1])
    cls = FwdParams if stage == "fwd" else BwdParams
    out: list[FwdParams | BwdParams] = []
    for bq in _BLOCKS:
        for bk in _BLOCKS:
            cfg = cls(q_blocksize=_block(t, bq), kv_blocksize=_block(s, bk))
            if cfg not in out:
                out.append(cfg)
    return out


def _interpret_params() -> Any:
    """TPU interpret mode (on CPU, for tests); races are looked for when ``EJKERNEL_PALLAS_DETECT_RACES=1``."""
    import os

    return pltpu.InterpretParams(detect_races=os.environ.get("EJKERNEL_PALLAS_DETECT_RACES") == "1")


def _pad(x: Any, axis: int, size: int) -> Any:
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def _attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None,
    q_segment_ids: jax.Array | None,
    kv_segment_ids: jax.Array | None,
    *,
    softmax_scale: float | None,
    causal: bool,
    sliding_window: int | tuple[int, int] | None,
    logits_soft_cap: float | None,
    fwd_params: FwdParams | None,
    bwd_params: BwdParams | None,
    interpret: Any,
) -> jax.Array:
    b, t, h, d = query.shape
    s, kh = key.shape[1], key.shape[2]
    fwd_p, bwd_p = fwd_params or FwdParams(), bwd_params or BwdParams()
    fwd_blocks = (_block(t, fwd_p.q_blocksize), _block(s, fwd_p.kv_blocksize))
    bwd_blocks = (_block(t, bwd_p.q_blocksize), _block(s, bwd_p.kv_blocksize))

    def geometry(blocks: tuple[int, int]) -> Geometry:
        return Geometry(
            t=t, s=s, bq=blocks[0], bk=blocks[1], group=h // kh,
            scale=float(d**-0.5 if softmax_scale is None else softmax_scale), causal=bool(causal),
            window=normalize_window(sliding_window),
            soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
            has_bias=bias is not None, bias_batch=bias is not None and bias.shape[0] > 1,
            bias_heads=bias is not None and bias.shape[1] > 1, has_segments=q_segment_ids is not None,
        )  # fmt: skip

    def layout(geo: Geometry, q: Any, k: Any, v: Any, bias: Any, qseg: Any, kseg: Any) -> Any:
        """Head-leading, padded to the blocks; the optional inputs in the order the kernels take them."""
        tp, sp = round_up(t, geo.bq), round_up(s, geo.bk)
        qh = _pad(q.transpose(0, 2, 1, 3), 2, tp)
        kh_, vh = _pad(k.transpose(0, 2, 1, 3), 2, sp), _pad(v.transpose(0, 2, 1, 3), 2, sp)
        extras = []
        if bias is not None:
            extras.append(_pad(_pad(bias, 2, tp), 3, sp))
        if qseg is not None:
            extras.append(_pad(qseg.astype(jnp.int32), 1, tp)[:, :, None])
            extras.append(_pad(kseg.astype(jnp.int32), 1, sp)[:, None, :])
        return qh, kh_, vh, extras

    geo_f, geo_b = geometry(fwd_blocks), geometry(bwd_blocks)

    # Segment ids are arguments, not closed over: custom_vjp functions must not capture traced values.
    @jax.custom_vjp
    def run(q: Any, k: Any, v: Any, bias: Any, qseg: Any, kseg: Any) -> Any:
        return fwd(q, k, v, bias, qseg, kseg)[0]

    def fwd(q: Any, k: Any, v: Any, bias: Any, qseg: Any, kseg: Any) -> Any:
        qh, kh_, vh, extras = layout(geo_f, q, k, v, bias, qseg, kseg)
        o, lse = forward(geo_f, qh, kh_, vh, extras, interpret)
        out = o[:, :, :t].transpose(0, 2, 1, 3)
        return out, (q, k, v, bias, qseg, kseg, out, lse)

    def bwd(res: Any, g: Any) -> Any:
        q, k, v, bias, qseg, kseg, out, lse = res
        qh, kh_, vh, extras = layout(geo_b, q, k, v, bias, qseg, kseg)
        tp = qh.shape[2]
        do = _pad(g.transpose(0, 2, 1, 3), 2, tp)
        delta = jnp.sum(do.astype(jnp.float32) * _pad(out.transpose(0, 2, 1, 3), 2, tp).astype(jnp.float32), -1)
        # lse was padded to the forward's blocks; the backward's may differ.
        lse = _pad(lse[:, :, :t], 2, tp)
        dq, dk, dv, dbias = backward(geo_b, qh, kh_, vh, extras, do.astype(q.dtype), lse, delta[..., None], interpret)
        dq = dq[:, :, :t].transpose(0, 2, 1, 3)
        group = h // kh
        dk = dk[:, :, :s].reshape(b, kh, group, s, d).sum(2, dtype=jnp.float32).transpose(0, 2, 1, 3).astype(k.dtype)
        dv = dv[:, :, :s].reshape(b, kh, group, s, -1).sum(2, dtype=jnp.float32).transpose(0, 2, 1, 3).astype(v.dtype)
        if dbias is not None:
            dbias = dbias[:, :, :t, :s]
            axes = tuple(i for i in (0, 1) if bias.shape[i] == 1)
            dbias = dbias.sum(axes, keepdims=True).astype(bias.dtype)
        return dq, dk, dv, dbias, None, None

    run.defvjp(fwd, bwd)
    return run(query, key, value, bias, q_segment_ids, kv_segment_ids)


def _make(interpret: Any) -> Any:
    def flash_attention(
        query: jax.Array,
        key: jax.Array,
        value: jax.Array,
        bias: jax.Array | None = None,
        *,
        attention_mask: jax.Array | None = None,
        q_segment_ids: jax.Array | None = None,
        kv_segment_ids: jax.Array | None = None,
        softmax_scale: float | None = None,
        causal: bool = False,
        sliding_window: int | tuple[int, int] | None = None,
        logits_soft_cap: float | None = None,
        dropout_prob: float = 0.0,
        dropout_seed: int | jax.Array | None = None,
        cu_seqlens_q: jax.Array | None = None,
        cu_seqlens_k: jax.Array | None = None,
        fwd_params: FwdParams | None = None,
        bwd_params: BwdParams | None = None,
    ) -> jax.Array:
        """Mosaic TPU flash attention; launch parameters: ``q_blocksize``/``kv_blocksize`` (multiples of 128)."""
        if attention_mask is not None or cu_seqlens_q is not None or dropout_prob:
            raise ValueError(
                "flash_attention (pallas:tpu): attention_mask, cu_seqlens and dropout are not served by this kernel"
            )
        return _attention(
            query, key, value, bias, q_segment_ids, kv_segment_ids, softmax_scale=softmax_scale, causal=causal,
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, fwd_params=fwd_params,
            bwd_params=bwd_params, interpret=interpret() if callable(interpret) else interpret,
        )  # fmt: skip

    return flash_attention


flash_attention = _make(False)
"""On a TPU: compiled by Mosaic."""
flash_attention_interpret = _make(_interpret_params)
"""On a CPU: the same kernels in JAX's TPU interpret mode (tests; slow)."""

__all__ = ["candidate_cfgs", "flash_attention", "flash_attention_interpret", "heuristic_cfg", "supports"]
