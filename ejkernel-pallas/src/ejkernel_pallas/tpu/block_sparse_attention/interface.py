"""Mosaic TPU ``block_sparse_attention`` (contract: ``ejkernel.modules.operations.block_sparse_attention``).

Serves every option of the contract: a block mask ``[B|1, H|1, NQ, NK]`` (traced or concrete) or the
patterns (``local_blocks``/``global_blocks``), causal (bottom-right aligned), segment ids, soft cap,
``softmax_scale``, GQA/MQA, ``Dv != D``, in float32 and bfloat16. It declines float16 (the TPU computes
in bfloat16 and float32 only) and masks whose blocks cannot be tiled for the TPU (below).

Tiles and the mask's granularity. A kernel tile ``(bq, bk)`` is a whole number of mask blocks:
``bq = rq * q_block``, ``bk = rk * kv_block``, so that tile pairs and mask blocks nest and a tile pair's
blocks are a ``[rq, rk]`` sub-array of the mask. ``bq`` is also a multiple of the sublane tile (8 rows,
16 for bfloat16) and ``bk`` of the 128 lanes (the key axis is the lane axis of the score tile and of
the key segment ids), unless one tile covers the whole axis. With the default 64-token mask blocks
that is ``128 x 128`` tiles of ``2 x 2`` mask blocks: a tile pair is visited when any of its blocks is
True, and its token mask is built from its blocks inside the kernel. (64-key tiles would leave half
the lanes of every score tile idle and could not tile the key segment ids; 64-row query tiles would
be legal but give the MXU half the rows per matmul.) Building the token mask costs one select per
mask row (or column) of the tile, so very fine masks (8-token blocks: 16 per 128-token tile) make
partial pairs several times dearer than full ones; full pairs skip it. Mask blocks that are already
TPU-sized (``q_block % 8 == 0``, ``kv_block % 128 == 0``) can be the tiles themselves (``rq = rk = 1``,
then an admitted pair needs no mask blocks at all). Tiles hold at most ``MAX_TILE`` tokens: a mask
whose ``lcm(kv_block, 128)`` (or ``lcm(q_block, 8|16)``) exceeds that, on an axis longer than that,
is declined (e.g. ``kv_block=100``: 3200-token key tiles). Without a mask (dense or causal only) the
tiles are flash attention's, unconstrained.

Launch parameters (``FwdParams`` for the forward, ``BwdParams`` for dQ and dK/dV): ``q_blocksize`` and
``kv_blocksize``, the wanted ``bq``/``bk`` in tokens, rounded down to the constraints above.

Sparse grids, by scalar prefetch of the lists of admitted tiles (``_schedule``, ``_kernels``): tiles
the mask (or causal, or disjoint segment ids) rules out are neither fetched nor computed. When the mask
is known at trace time (the patterns, or a concrete array) the grid is as long as the longest list;
a traced mask gives grids as long as the structure allows, whose surplus steps are empty. The lists
take ``2 * Lb * Lh * nqt * nkt`` int32 of SMEM (``Lb``/``Lh``: B or 1, H or 1, what the mask and the
segment ids vary over).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from ejkernel.device import round_up
from ejkernel.modules.operations.block_sparse_attention import block_sparse_mask
from ejkernel.ops.utils.datacarrier import BwdParams, FwdParams

from ejkernel_pallas.tpu.block_sparse_attention import _schedule
from ejkernel_pallas.tpu.block_sparse_attention._kernels import Geometry, backward, forward
from ejkernel_pallas.tpu.block_sparse_attention._schedule import Tiling

SUPPORTED_DTYPES = ("float32", "bfloat16")
LANES = 128
MAX_TILE = 2048  # tokens: a key tile of 2048 x 128 bfloat16, keys and values double-buffered, is 2 MiB of VMEM
_TILES = (128, 256, 512)


def sublanes(dtype: Any) -> int:
    """Rows of a vector register tile: 8 of 32 bits (16 for bfloat16)."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def tile(n: int, unit: int, align: int, wanted: int) -> int | None:
    """Tokens per tile along an axis of ``n`` tokens: the whole axis (rounded up to ``unit``) in one tile when
    ``wanted`` covers it, else a multiple of ``unit`` (the mask block) and ``align`` near ``wanted``, at most
    ``MAX_TILE``. None when no such tile exists (``lcm(unit, align)`` and the whole axis exceed ``MAX_TILE``).
    Idempotent: a returned tile, asked for again, is returned."""
    whole = round_up(n, unit)
    step = math.lcm(unit, align)
    if whole <= MAX_TILE and (wanted >= whole or step >= whole):
        return whole  # one tile: its blocks are the arrays' whole dims, any size
    if step > MAX_TILE:
        return None
    size = max(step, min(int(wanted), MAX_TILE) // step * step)
    return whole if size >= whole else size


def _mask_of(a: dict[str, Any]) -> Any:
    """The block mask the call uses: ``block_mask``, else the patterns' (NumPy ``[1, 1, NQ, NK]``); None when every
    block is attended."""
    if a["block_mask"] is not None:
        return a["block_mask"]
    if a["local_blocks"] is None and not a["global_blocks"]:
        return None
    t, s = int(a["query"].shape[1]), int(a["key"].shape[1])
    pattern = block_sparse_mask(
        t, s, q_block=a["q_block"], kv_block=a["kv_block"], local_blocks=a["local_blocks"],
        global_blocks=a["global_blocks"], causal=a["causal"],
    )  # fmt: skip
    return None if pattern.all() else pattern[None, None]


def _default_wanted(n: int, block: int, masked: bool) -> int:
    if masked:
        return max(LANES, block)  # 2 x 2 blocks of the default 64: the mask's resolution is kept where it can be
    return 128 if n < 1024 else 512


def _tiles(a: dict[str, Any], masked: bool, params: Any) -> tuple[int | None, int | None]:
    t, s = int(a["query"].shape[1]), int(a["key"].shape[1])
    qb, kb = (int(a["q_block"]), int(a["kv_block"])) if masked else (1, 1)
    wq = params.q_blocksize if params is not None and params.q_blocksize else _default_wanted(t, qb, masked)
    wk = params.kv_blocksize if params is not None and params.kv_blocksize else _default_wanted(s, kb, masked)
    return tile(t, qb, sublanes(a["query"].dtype), wq), tile(s, kb, LANES, wk)


def _untileable(a: dict[str, Any], masked: bool) -> str | None:
    """Why the mask's blocks cannot be tiled for the TPU, or None."""
    bq, bk = _tiles(a, masked, None)
    for size, name, n, align in (
        (bq, "q_block", a["query"].shape[1], sublanes(a["query"].dtype)),
        (bk, "kv_block", a["key"].shape[1], LANES),
    ):
        if size is None:
            block = int(a[name])
            return (
                f"{name}={block} over {n} tokens: a tile must hold whole mask blocks and a multiple of {align} "
                f"tokens, i.e. {math.lcm(block, align)} of them, over the {MAX_TILE}-token limit"
            )
    return None


def supports(inv: Any) -> str | None:
    """``None`` when this kernel serves ``inv``, else the reason it does not."""
    a = inv.arguments
    dtype = str(np.dtype(a["query"].dtype))
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} (Mosaic TPU kernels take float32 or bfloat16; the TPU does not compute in float16)"
    return _untileable(a, _mask_of(a) is not None)


def heuristic_cfg(inv: Any, stage: str) -> FwdParams | BwdParams:
    a = inv.arguments
    bq, bk = _tiles(a, _mask_of(a) is not None, None)
    cls = FwdParams if stage == "fwd" else BwdParams
    return cls(q_blocksize=bq, kv_blocksize=bk)


def candidate_cfgs(inv: Any, stage: str) -> list[FwdParams | BwdParams]:
    a = inv.arguments
    masked = _mask_of(a) is not None
    cls = FwdParams if stage == "fwd" else BwdParams
    out: list[FwdParams | BwdParams] = [heuristic_cfg(inv, stage)]
    for wq in _TILES:
        for wk in _TILES:
            bq, bk = _tiles(a, masked, cls(q_blocksize=wq, kv_blocksize=wk))
            cfg = cls(q_blocksize=bq, kv_blocksize=bk)
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
    a: dict[str, Any],
    fwd_params: FwdParams | None,
    bwd_params: BwdParams | None,
    interpret: Any,
) -> jax.Array:
    b, t, h, d = query.shape
    s, kh = key.shape[1], key.shape[2]
    mask = _mask_of(a)
    masked = mask is not None
    reason = _untileable(a, masked)
    if reason is not None:
        raise ValueError(f"block_sparse_attention (pallas:tpu): {reason}")
    qseg, kseg = a["q_segment_ids"], a["kv_segment_ids"]
    if (qseg is None) != (kseg is None):
        raise ValueError("block_sparse_attention (pallas:tpu): pass both q_segment_ids and kv_segment_ids, or neither")
    known = _schedule.concrete(mask)  # the patterns, or a mask known at trace time: exact grid lengths

    def tiling(params: Any) -> Tiling:
        bq, bk = _tiles(a, masked, params)
        assert bq is not None and bk is not None
        unit_q, unit_k = (int(a["q_block"]), int(a["kv_block"])) if masked else (1, 1)
        return Tiling(t=t, s=s, bq=bq, bk=bk, q_block=unit_q, kv_block=unit_k, causal=bool(a["causal"]))

    def geometry(tl: Tiling, sched: _schedule.Schedule) -> Geometry:
        kv_steps, q_steps = _schedule.static_steps(tl, known)
        return Geometry(
            t=t, s=s, bq=tl.bq, bk=tl.bk, nqt=tl.nqt, nkt=tl.nkt, group=h // kh,
            scale=float(d**-0.5 if a["softmax_scale"] is None else a["softmax_scale"]), causal=bool(a["causal"]),
            soft_cap=None if a["logits_soft_cap"] is None else float(a["logits_soft_cap"]),
            has_segments=qseg is not None, lanes=sched.lanes,
            mask_lanes=None if sched.sub is None else (int(mask.shape[0]), int(mask.shape[1])),
            q_block=tl.q_block, kv_block=tl.kv_block, kv_steps=kv_steps, q_steps=q_steps,
        )  # fmt: skip

    def layout(tl: Tiling, sched: _schedule.Schedule, q: Any, k: Any, v: Any, qs: Any, ks: Any) -> Any:
        """Head-leading, padded to the tiles; the optional inputs in the order the kernels take them."""
        tp, sp = tl.nqt * tl.bq, tl.nkt * tl.bk
        qh = _pad(q.transpose(0, 2, 1, 3), 2, tp)
        kh_, vh = _pad(k.transpose(0, 2, 1, 3), 2, sp), _pad(v.transpose(0, 2, 1, 3), 2, sp)
        extras = [] if sched.sub is None else [sched.sub]
        if qs is not None:
            extras.append(_pad(qs.astype(jnp.int32), 1, tp)[:, :, None])
            extras.append(_pad(ks.astype(jnp.int32), 1, sp)[:, None, :])
        return qh, kh_, vh, extras

    tl_f, tl_b = tiling(fwd_params), tiling(bwd_params)

    # The mask and segment ids are arguments, not closed over: custom_vjp functions must not capture traced values.
    @jax.custom_vjp
    def run(q: Any, k: Any, v: Any, m: Any, qs: Any, ks: Any) -> Any:
        return fwd(q, k, v, m, qs, ks)[0]

    def fwd(q: Any, k: Any, v: Any, m: Any, qs: Any, ks: Any) -> Any:
        sched = _schedule.build(tl_f, m, qs, ks)
        geo = geometry(tl_f, sched)
        qh, kh_, vh, extras = layout(tl_f, sched, q, k, v, qs, ks)
        o, lse = forward(geo, sched, qh, kh_, vh, extras, interpret)
        out = o[:, :, :t].transpose(0, 2, 1, 3)
        return out, (q, k, v, m, qs, ks, out, lse[:, :, :t])

    def bwd(res: Any, g: Any) -> Any:
        q, k, v, m, qs, ks, out, lse = res
        sched = _schedule.build(tl_b, m, qs, ks)
        geo = geometry(tl_b, sched)
        qh, kh_, vh, extras = layout(tl_b, sched, q, k, v, qs, ks)
        tp = qh.shape[2]
        do = _pad(g.transpose(0, 2, 1, 3), 2, tp)
        delta = jnp.sum(do.astype(jnp.float32) * _pad(out.transpose(0, 2, 1, 3), 2, tp).astype(jnp.float32), -1)
        dq, dk, dv = backward(
            geo, sched, qh, kh_, vh, extras, do.astype(q.dtype), _pad(lse, 2, tp), delta[..., None], interpret
        )
        dq = dq[:, :, :t].transpose(0, 2, 1, 3)
        return dq, dk[:, :, :s].transpose(0, 2, 1, 3), dv[:, :, :s].transpose(0, 2, 1, 3), None, None, None

    run.defvjp(fwd, bwd)
    return run(query, key, value, None if mask is None else jnp.asarray(mask, bool), qseg, kseg)


def _make(interpret: Any) -> Any:
    def block_sparse_attention(
        query: jax.Array,
        key: jax.Array,
        value: jax.Array,
        *,
        block_mask: jax.Array | None = None,
        q_segment_ids: jax.Array | None = None,
        kv_segment_ids: jax.Array | None = None,
        q_block: int = 64,
        kv_block: int = 64,
        local_blocks: int | tuple[int, int] | None = None,
        global_blocks: int = 0,
        causal: bool = False,
        softmax_scale: float | None = None,
        logits_soft_cap: float | None = None,
        fwd_params: FwdParams | None = None,
        bwd_params: BwdParams | None = None,
    ) -> jax.Array:
        """Mosaic TPU block-sparse attention; launch parameters ``q_blocksize``/``kv_blocksize`` (tile tokens)."""
        arguments = {
            "query": query, "key": key, "block_mask": block_mask, "q_segment_ids": q_segment_ids,
            "kv_segment_ids": kv_segment_ids, "q_block": int(q_block), "kv_block": int(kv_block),
            "local_blocks": local_blocks, "global_blocks": int(global_blocks), "causal": bool(causal),
            "softmax_scale": softmax_scale, "logits_soft_cap": logits_soft_cap,
        }  # fmt: skip
        return _attention(
            query, key, value, arguments, fwd_params, bwd_params, interpret() if callable(interpret) else interpret
        )

    return block_sparse_attention


block_sparse_attention = _make(False)
"""On a TPU: compiled by Mosaic."""
block_sparse_attention_interpret = _make(_interpret_params)
"""On a CPU: the same kernels in JAX's TPU interpret mode (tests; slow)."""

__all__ = [
    "block_sparse_attention",
    "block_sparse_attention_interpret",
    "candidate_cfgs",
    "heuristic_cfg",
    "supports",
]
