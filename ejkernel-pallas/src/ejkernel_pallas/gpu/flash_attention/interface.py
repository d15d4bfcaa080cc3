"""Mosaic GPU ``flash_attention`` for Hopper (contract: ``ejkernel.modules.operations.flash_attention``).

Serves bfloat16 and float16, head dims up to 256 (padded with zeros to 64, 128 or 256), causal
(bottom-right aligned) or not, GQA/MQA and any ``softmax_scale``, at any lengths (queries padded to
the CTA's 128 rows, keys to the key block, padded keys masked). It declines (``supports``) float32,
bias, ``attention_mask``, segment ids, sliding windows, soft cap, dropout, varlen packing
(``cu_seqlens``), ``Dv != D``, head dims above 256 and GPUs older than Hopper (sm_90).

The forward is a warp-specialised Mosaic GPU kernel (``_kernels.forward``). The backward keeps
``(out, lse)`` only and recomputes the probabilities block by block in plain ``jax.numpy``
(``_kernels.backward``: O(T * kv_blocksize) extra memory); it is not a Mosaic GPU kernel yet.

Launch parameters: forward ``kv_blocksize`` (64, 128 or 256) and ``num_stages`` (the K/V ring's
depth, 2 to 4); ``q_blocksize`` is fixed at 128 (two 64-row consumer warpgroups). Backward
``kv_blocksize``: keys per step of the recompute.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.device import first_gpu, fold_vmap, round_up, shared_memory_per_block
from ejkernel.ops.utils.datacarrier import BwdParams, FwdParams

from ejkernel_pallas.gpu.flash_attention._kernels import BLOCK_Q, CONSUMERS, Geometry, backward, forward

SUPPORTED_DTYPES = ("bfloat16", "float16")
HEAD_DIMS = (64, 128, 256)
Q_ROWS = CONSUMERS * BLOCK_Q  # query rows per CTA
_KV_BLOCKS = (64, 128, 256)
_STAGES = (2, 3, 4)
# Hopper's opt-in shared memory per block, less 3 KiB: Mosaic GPU aligns buffers and adds the
# barriers (seen on an H200: 2.6 KiB over the sum of the buffers).
_SMEM_LIMIT = shared_memory_per_block((9, 0)) - 3 * 1024
_BWD_BLOCK = 512


def _padded_head_dim(d: int) -> int:
    return next(p for p in HEAD_DIMS if d <= p)


def _gpu_too_old() -> str | None:
    """A reason when the local GPU is not a Hopper (or newer) part; ``None`` when it is or none is visible."""
    gpu = first_gpu()
    if gpu is not None and gpu.compute_capability is not None and not gpu.has_capability(9, 0):
        cc = ".".join(map(str, gpu.compute_capability))
        return f"compute capability {cc} (the Mosaic GPU kernel needs Hopper, sm_90: TMA and wgmma)"
    return None


def supports(inv: Any) -> str | None:
    """``None`` when this kernel serves ``inv``, else the reason it does not."""
    a = inv.arguments
    dtype = str(np.dtype(a["query"].dtype))
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} (the Mosaic GPU kernel takes bfloat16 or float16)"
    for name, why in (
        ("bias", "bias"),
        ("attention_mask", "an attention_mask"),
        ("q_segment_ids", "segment ids (q_segment_ids/kv_segment_ids)"),
        ("sliding_window", "a sliding_window"),
        ("logits_soft_cap", "logits_soft_cap"),
        ("cu_seqlens_q", "varlen packing (cu_seqlens_q/cu_seqlens_k)"),
    ):
        if a.get(name) is not None:
            return why
    if a.get("dropout_prob", 0.0):
        return "dropout"
    d, dv = int(a["query"].shape[-1]), int(a["value"].shape[-1])
    if dv != d:
        return f"a value head dim Dv={dv} different from D={d}"
    if d > HEAD_DIMS[-1]:
        return f"head dim D={d} (at most {HEAD_DIMS[-1]})"
    if getattr(inv, "backend", "gpu") == "gpu":
        return _gpu_too_old()
    return None


def _fwd_blocks(s: int, d: int, kv_blocksize: int | None, num_stages: int | None) -> tuple[int, int]:
    """(key block, stages): the defaults are the largest key block that fits two stages and the registers."""
    dp = _padded_head_dim(d)
    bk = kv_blocksize or {64: 256, 128: 128, 256: 64}[dp]
    bk = min(round_up(max(int(bk), 64), 64), round_up(s, 64), 256)
    return bk, int(num_stages or 2)


def _fits(bk: int, d: int, stages: int) -> bool:
    dp = _padded_head_dim(d)
    geo_smem = (Q_ROWS * dp + 2 * stages * bk * dp) * 2 + Q_ROWS * 4
    # f32 scores (bk/2) and accumulator (dp/2) registers per consumer thread, out of 232.
    return geo_smem <= _SMEM_LIMIT and bk + dp <= 384


def heuristic_cfg(inv: Any, stage: str) -> FwdParams | BwdParams:
    s, d = int(inv.arguments["key"].shape[1]), int(inv.arguments["query"].shape[-1])
    if stage == "fwd":
        bk, stages = _fwd_blocks(s, d, None, None)
        return FwdParams(q_blocksize=Q_ROWS, kv_blocksize=bk, num_stages=stages)
    return BwdParams(kv_blocksize=min(_BWD_BLOCK, round_up(s, 64)))


def candidate_cfgs(inv: Any, stage: str) -> list[FwdParams | BwdParams]:
    s, d = int(inv.arguments["key"].shape[1]), int(inv.arguments["query"].shape[-1])
    if stage != "fwd":
        return [BwdParams(kv_blocksize=min(b, round_up(s, 64))) for b in (256, 512, 1024)]
    out: list[FwdParams | BwdParams] = []
    for want in _KV_BLOCKS:
        for stages in _STAGES:
            bk, _ = _fwd_blocks(s, d, want, stages)
            cfg = FwdParams(q_blocksize=Q_ROWS, kv_blocksize=bk, num_stages=stages)
            if _fits(bk, d, stages) and cfg not in out:
                out.append(cfg)
    return out


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
    *,
    softmax_scale: float | None,
    causal: bool,
    fwd_params: FwdParams | None,
    bwd_params: BwdParams | None,
    interpret: Any,
) -> jax.Array:
    b, t, h, d = query.shape
    s, kh = key.shape[1], key.shape[2]
    fwd_p, bwd_p = fwd_params or FwdParams(), bwd_params or BwdParams()
    if fwd_p.q_blocksize not in (None, Q_ROWS):
        raise ValueError(f"flash_attention (pallas:gpu): q_blocksize must be {Q_ROWS}, got {fwd_p.q_blocksize}")
    # Launch fields this kernel has no use for are refused, not ignored: the warpgroups are fixed, and
    # the backward (a jnp recompute) takes only its key block.
    for field, given in (
        ("fwd_params.num_warps", fwd_p.num_warps),
        ("bwd_params.q_blocksize", bwd_p.q_blocksize),
        ("bwd_params.num_warps", bwd_p.num_warps),
        ("bwd_params.num_stages", bwd_p.num_stages),
    ):
        if given is not None:
            raise ValueError(
                f"flash_attention (pallas:gpu): {field} is not used by this kernel (leave it None), got {given}"
            )
    bk, stages = _fwd_blocks(s, d, fwd_p.kv_blocksize, fwd_p.num_stages)
    dp = _padded_head_dim(d)
    scale = float(d**-0.5 if softmax_scale is None else softmax_scale)
    geo = Geometry(
        t=t, s=s, tp=round_up(t, Q_ROWS), sp=round_up(s, bk), d=dp, bk=bk, stages=stages, group=h // kh,
        scale=scale, causal=bool(causal), dtype=str(np.dtype(query.dtype)),
    )  # fmt: skip
    if geo.smem_bytes > _SMEM_LIMIT:
        raise ValueError(
            f"flash_attention (pallas:gpu): kv_blocksize={bk}, num_stages={stages} at D={dp} need "
            f"{geo.smem_bytes} bytes of shared memory (at most {_SMEM_LIMIT})"
        )
    bwd_block = int(bwd_p.kv_blocksize or min(_BWD_BLOCK, round_up(s, 64)))
    # vmap folds into the batch (one bigger grid): every row of q, k, v, out and lse is one batch's
    kernel = fold_vmap(lambda q, k, v: forward(geo, q, k, v, interpret), in_axes=(0, 0, 0), out_axes=(0, 0))

    @jax.custom_vjp
    def run(q: Any, k: Any, v: Any) -> Any:
        return fwd(q, k, v)[0]

    def fwd(q: Any, k: Any, v: Any) -> Any:
        qp = _pad(_pad(q, 3, dp), 1, geo.tp)
        kp, vp = (_pad(_pad(x, 3, dp), 1, geo.sp) for x in (k, v))
        o, lse = kernel(qp, kp, vp)
        out = o[:, :t, :, :d]
        return out, (q, k, v, out, lse[:, :, :t])

    def bwd(res: Any, g: Any) -> Any:
        q, k, v, out, lse = res
        return backward(geo, q, k, v, out, lse, g, bwd_block)

    run.defvjp(fwd, bwd)
    return run(query, key, value)


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
        """Mosaic GPU flash attention (Hopper); see the module docstring for what it serves."""
        unserved = [
            name
            for name, given in (
                ("bias", bias is not None),
                ("attention_mask", attention_mask is not None),
                ("q_segment_ids/kv_segment_ids", q_segment_ids is not None or kv_segment_ids is not None),
                ("sliding_window", sliding_window is not None),
                ("logits_soft_cap", logits_soft_cap is not None),
                ("dropout_prob", bool(dropout_prob)),
                ("cu_seqlens_q/cu_seqlens_k", cu_seqlens_q is not None or cu_seqlens_k is not None),
            )
            if given
        ]
        if unserved:
            raise ValueError(f"flash_attention (pallas:gpu): not served by this kernel: {', '.join(unserved)}")
        return _attention(
            query, key, value, softmax_scale=softmax_scale, causal=causal, fwd_params=fwd_params,
            bwd_params=bwd_params, interpret=interpret() if callable(interpret) else interpret,
        )  # fmt: skip

    return flash_attention


def _interpret_params() -> Any:
    """JAX's Mosaic GPU interpret mode (CPU; simulates SMEM, the warpgroups, TMA and barriers)."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


flash_attention = _make(None)
"""On a Hopper GPU: compiled by Mosaic GPU."""
flash_attention_interpret = _make(_interpret_params)
"""On a CPU: the same kernel in JAX's Mosaic GPU interpret mode (tests; slow)."""

__all__ = ["candidate_cfgs", "flash_attention", "flash_attention_interpret", "heuristic_cfg", "supports"]
