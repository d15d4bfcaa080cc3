"""JAX-level flash attention on the Triton kernels of ``_kernels.py``, with a ``jax.custom_vjp``.

The forward saves ``(q, k, v, bias, o, lse)``; the backward runs three kernels (delta, dK/dV, dQ)
and, when there is a bias, a fourth for dBias. Memory beyond inputs and outputs is O(T) (lse,
delta, the per-row/per-key intervals) plus dBias, which has the bias's own shape.

Float32 inputs use full-precision float32 dots (``input_precision="ieee"``, not tf32); bfloat16 and
float16 inputs use tensor-core dots with float32 accumulation; softmax statistics are always float32.

Importing this module does not import Triton: the kernels (and the interpreter switch of
``ejkernel_triton.launch``) load on the first call, so ``supports``/``heuristic_cfg``/
``candidate_cfgs`` work where Triton is missing.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import itertools
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.device import cdiv, first_gpu, fold_vmap, next_power_of_2, shared_memory_per_block
from ejkernel.kernels.signatures._attention import mask_intervals
from ejkernel.modules.operations.flash_attention import validate
from ejkernel.ops.utils.datacarrier import BwdParams, FwdParams

__all__ = ["candidate_cfgs", "flash_attention", "heuristic_cfg", "supports"]

_MAX_HEAD_DIM = 256
_INTERPRET_BLOCK = 32  # default block in Triton's interpreter (CPU tests): small and quick


def _kernels() -> Any:
    from ejkernel_triton.flash_attention import _kernels as k

    return k


def _launch_module() -> Any:
    from ejkernel_triton import launch

    return launch


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, next_power_of_2(n))


def _smem_bytes() -> int:
    """Opt-in shared memory per block of the local GPU; without one, Hopper's (what the configs target)."""
    gpu = first_gpu()
    return (gpu and gpu.shared_memory_per_block) or shared_memory_per_block((9, 0))


# ------------------------------------------------------------------------------------------------
# Launch configurations.
# ------------------------------------------------------------------------------------------------


def _arguments(invocation: Any) -> Mapping[str, Any]:
    args = getattr(invocation, "arguments", invocation)
    if not isinstance(args, Mapping):
        raise TypeError(f"expected an invocation with an .arguments mapping, got {type(invocation).__name__}")
    return args


def _score_bytes(bias: Any, attention_mask: Any) -> int:
    """Bytes per score loaded beside Q, K and V (a bias tile, a dense mask tile), buffered per stage like K and V."""
    out = 0 if bias is None else int(np.dtype(bias.dtype).itemsize)
    return out + (0 if attention_mask is None else 1)  # the mask goes to the kernels as int8


def _problem(invocation: Any) -> tuple[int, int, int, int, int, int]:
    """(T, S, D, Dv, bytes per element, bytes per score of bias and mask) of a call."""
    args = _arguments(invocation)
    q, k, v = args["query"], args["key"], args["value"]
    x = _score_bytes(args.get("bias"), args.get("attention_mask"))
    return int(q.shape[1]), int(k.shape[1]), int(q.shape[-1]), int(v.shape[-1]), int(np.dtype(q.dtype).itemsize), x


def _smem_fwd(bm: int, bn: int, stages: int, bd: int, bdv: int, e: int, x: int = 0) -> int:
    # the query tile, `stages` buffered K and V tiles (and bias/mask tiles: x bytes per score), and P staged
    # for the second dot
    return e * (bm * bd + stages * bn * (bd + bdv) + bm * bn) + x * stages * bm * bn


def _smem_bwd(bm: int, bn: int, stages: int, bd: int, bdv: int, e: int, x: int = 0) -> int:
    # With the backward's tile rule (see _backward) both kernels hold bn rows (dK/dV: K, V; dQ: Q,
    # dO) and stream bm rows (dK/dV: Q, dO; dQ: K, V) with their bias/mask tiles, plus one [bn, bm] P/dS tile.
    return e * (bn * (bd + bdv) + stages * bm * (bd + bdv) + bm * bn) + x * stages * bm * bn


def _regs_ok(stage: str, bm: int, bn: int, warps: int, bd: int, bdv: int) -> bool:
    # float32 accumulators and score tiles per thread; past ~200 the kernel spills. Backward: the
    # dK/dV kernel's dK and dV accumulators (bn rows) outweigh the dQ kernel's dQ (bn rows too).
    threads = 32 * warps
    if stage == "fwd":
        live = bm * bdv + bm * bn
    else:
        live = bn * (bd + bdv) + 2 * bm * bn
    return live / threads <= 200


def _fits(stage: str, bm: int, bn: int, warps: int, stages: int, bd: int, bdv: int, e: int, x: int = 0) -> bool:
    smem = (_smem_fwd if stage == "fwd" else _smem_bwd)(bm, bn, stages, bd, bdv, e, x)
    return smem <= _smem_bytes() and _regs_ok(stage, bm, bn, warps, bd, bdv)


def _heuristic_tuple(
    stage: str, d: int, dv: int, e: int, t: int = 1 << 20, s: int = 1 << 20, x: int = 0
) -> tuple[int, int, int, int]:
    """Hopper (H100/H200) launch configs; blocks no longer than the (power-of-two rounded)
    sequences they tile.

    Forward: after the Triton fused-attention tutorial; on an H200 (bf16, D=128, T=S=8192) no
    other config of a sweep was more than 1% faster. Backward: ``(q_blocksize, kv_blocksize)``
    = (streamed, held) tiles of both backward kernels (see ``_backward``). D=128: the best of a
    sweep on an H200 (64 x 128, 8 warps, 3 stages; forward+backward 1.9x the symmetric 64 x 64
    it replaced, see BENCHMARKS.md). D=64 takes the same tiles (measured, not swept); D=256 keeps
    the held tile the longer and was not measured."""
    bd = max(_pow2(d), _pow2(dv))
    if stage == "fwd":
        if bd <= 64:
            cfg = (128, 64, 4, 3)
        elif bd <= 128:
            cfg = (128, 64, 8, 3)
        else:
            cfg = (64, 64, 4, 2)
    else:
        if bd <= 64:
            cfg = (64, 128, 8, 3)
        elif bd <= 128:
            cfg = (64, 128, 8, 3)
        else:
            cfg = (32, 64, 8, 2)
    bm, bn, warps, stages = cfg
    if stage == "fwd":
        bm, bn = min(bm, _pow2(t)), min(bn, _pow2(s))
    else:  # each backward block tiles queries in one kernel and keys in the other
        bm, bn = min(bm, _pow2(t), _pow2(s)), min(bn, _pow2(t), _pow2(s))
    bdq, bdvq = _pow2(d), _pow2(dv)
    # float32 inputs, a bias or mask (``x`` bytes per score), or odd head dims may not fit: fewer stages, then
    # smaller blocks. (A float32 MQA call with a bias asked for 240 KiB on an H200 before the bias was counted.)
    while not _fits(stage, bm, bn, warps, stages, bdq, bdvq, e, x):
        if stages > 1:
            stages -= 1
        elif bn > 16 and bn >= bm:
            bn //= 2
        elif bm > 16:
            bm //= 2
        else:
            break
    return bm, bn, warps, stages


def heuristic_cfg(invocation: Any, stage: str = "fwd") -> FwdParams | BwdParams:
    """The default launch parameters for ``stage`` ("fwd" or "bwd") of this call."""
    t, s, d, dv, e, x = _problem(invocation)
    bm, bn, warps, stages = _heuristic_tuple(stage, d, dv, e, t, s, x)
    cls = FwdParams if stage == "fwd" else BwdParams
    return cls(q_blocksize=bm, kv_blocksize=bn, num_warps=warps, num_stages=stages)


def candidate_cfgs(invocation: Any, stage: str = "fwd") -> list[FwdParams | BwdParams]:
    """Launch parameters worth timing for ``stage``: block sizes x warps x stages, without those
    whose shared memory (the GPU's per-block limit) or float32 register tiles would not fit; the heuristic first.

    The grid is cut where an H200 sweep (BENCHMARKS.md) found no winner, because every candidate costs
    a Triton compile (seconds) when the autotuner times it: the forward keeps 3 stages and key tiles of
    64 or 128 (2 or 4 stages and 32-key tiles were 5-20% slower), the backward 8 warps, and streamed
    tiles of 32 or 64 no longer than the held one (4 warps and 16-row tiles lost by 30% or more)."""
    t, s, d, dv, e, x = _problem(invocation)
    bd, bdv = _pow2(d), _pow2(dv)
    cls = FwdParams if stage == "fwd" else BwdParams
    grid: Iterable[tuple[int, int, int, int]]
    if stage == "fwd":
        grid = itertools.product((64, 128), (64, 128), (4, 8), (3,))
    else:
        grid = ((bm, bn, 8, st) for bm in (32, 64) for bn in (64, 128) for st in (2, 3) if bm <= bn)
    # no block much longer than the sequence it tiles (backward blocks tile both, see _backward)
    max_bm, max_bn = (_pow2(t), _pow2(s)) if stage == "fwd" else (min(_pow2(t), _pow2(s)),) * 2
    out = [_heuristic_tuple(stage, d, dv, e, t, s, x)]
    for bm, bn, warps, stages in grid:
        if bm > max_bm or bn > max_bn or not _fits(stage, bm, bn, warps, stages, bd, bdv, e, x):
            continue
        if (bm, bn, warps, stages) not in out:
            out.append((bm, bn, warps, stages))
    return [cls(q_blocksize=bm, kv_blocksize=bn, num_warps=w, num_stages=st) for bm, bn, w, st in out]


def supports(invocation: Any) -> str | None:
    """None when the Triton kernels can run this call, else why not."""
    args = _arguments(invocation)
    q, k, v = args["query"], args["key"], args["value"]
    for name, x in (("query", q), ("key", k), ("value", v)):
        dt = np.dtype(x.dtype)
        if dt.name not in ("float32", "bfloat16", "float16"):
            return (
                f"ejkernel-triton flash_attention: {name} dtype {dt.name} is not supported (float32, bfloat16, float16)"
            )
    d, dv = int(q.shape[-1]), int(v.shape[-1])
    if d > _MAX_HEAD_DIM or dv > _MAX_HEAD_DIM:
        return f"ejkernel-triton flash_attention: head dims up to {_MAX_HEAD_DIM} are supported, got D={d}, Dv={dv}"
    if d < 1 or dv < 1:
        return f"ejkernel-triton flash_attention: empty head dim (D={d}, Dv={dv})"
    bias = args.get("bias")
    if bias is not None and np.dtype(bias.dtype).name not in ("float32", "bfloat16", "float16"):
        return f"ejkernel-triton flash_attention: bias dtype {np.dtype(bias.dtype).name} is not supported"
    if importlib.util.find_spec("triton") is None:  # find, don't import: see ejkernel_triton.launch
        return "ejkernel-triton flash_attention: triton is not installed"
    return None


@dataclasses.dataclass(frozen=True)
class _Cfg:
    """Everything static about one call: the custom_vjp's non-differentiable argument."""

    scale: float
    softcap: float | None
    dropout_prob: float
    fwd: tuple[int, int, int, int]  # (BM, BN, warps, stages)
    bwd: tuple[int, int, int, int]  # (streamed block, held block, warps, stages): see _backward

    @property
    def drop_thresh(self) -> int:
        # the integer threshold of dropout_keep: keep iff hash >= p * 2**32 (0: no dropout)
        return min(int(self.dropout_prob * 2**32), 2**32 - 1) if self.dropout_prob > 0 else 0

    @property
    def drop_scale(self) -> float:
        return 1.0 / (1.0 - self.dropout_prob) if self.dropout_prob > 0 else 1.0


def _resolve(
    params: FwdParams | BwdParams | None, default: tuple[int, int, int, int], what: str
) -> tuple[int, int, int, int]:
    fields = ("q_blocksize", "kv_blocksize", "num_warps", "num_stages")
    got = tuple(
        default[i] if params is None or getattr(params, f) is None else int(getattr(params, f))
        for i, f in enumerate(fields)
    )
    for f, x in zip(fields[:2], got[:2], strict=True):
        if x < 16 or x & (x - 1):
            raise ValueError(f"ejkernel-triton flash_attention: {what}.{f} must be a power of two >= 16, got {x}")
    if got[2] < 1 or got[2] & (got[2] - 1):
        raise ValueError(f"ejkernel-triton flash_attention: {what}.num_warps must be a power of two, got {got[2]}")
    if got[3] < 1:
        raise ValueError(f"ejkernel-triton flash_attention: {what}.num_stages must be >= 1, got {got[3]}")
    return got  # type: ignore[return-value]


# ------------------------------------------------------------------------------------------------
# Launches.
# ------------------------------------------------------------------------------------------------

_DUMMY_F = np.zeros((16,), np.float32)  # stands in for absent optional arrays (never read)
_DUMMY_I8 = np.zeros((16,), np.int8)
_DUMMY_I32 = np.zeros((16,), np.int32)
_DUMMY_U32 = np.zeros((16,), np.uint32)


def _bcast_strides(x: Any, t: int, s: int) -> tuple[int, int]:
    """Element strides of a ``[NB|1, NH|1, T, S]`` array along batch and head (0 where broadcast)."""
    nb, nh = x.shape[0], x.shape[1]
    return (0 if nb == 1 else nh * t * s), (0 if nh == 1 else t * s)


def _common(
    cfg: _Cfg, q: Any, k: Any, v: Any, bias: Any, aux: dict[str, Any]
) -> tuple[list[Any], list[Any], dict[str, Any]]:
    """Shared array arguments, scalar arguments and constexprs of the four attention kernels."""
    b, t, h, d = q.shape
    s, kh, dv = k.shape[1], k.shape[2], v.shape[-1]
    bias_arr = bias if bias is not None else _DUMMY_F
    mask = aux["mask"]
    bias_sb, bias_sh = _bcast_strides(bias, t, s) if bias is not None else (0, 0)
    mask_sb, mask_sh = _bcast_strides(mask, t, s) if mask is not None else (0, 0)
    arrays = [
        bias_arr,
        mask if mask is not None else _DUMMY_I8,
        aux["q_seg"] if aux["q_seg"] is not None else _DUMMY_I32,
        aux["kv_seg"] if aux["kv_seg"] is not None else _DUMMY_I32,
        aux["row_lo"],
        aux["row_hi"],
    ]
    scalars = [
        float(cfg.scale),
        float(cfg.softcap) if cfg.softcap is not None else 1.0,
        float(cfg.drop_scale),
        int(t),
        int(s),
        int(bias_sb),
        int(bias_sh),
        int(mask_sb),
        int(mask_sh),
    ]
    constexprs = dict(
        H=h,
        KH=kh,
        D=d,
        DV=dv,
        BLOCK_D=_pow2(d),
        BLOCK_DV=_pow2(dv),
        HAS_MASK=mask is not None,
        HAS_SEG=aux["q_seg"] is not None,
        ROWS_PER_BATCH=aux["row_lo"].shape[0] > 1,
        HAS_SOFTCAP=cfg.softcap is not None,
        DROP_THRESH=cfg.drop_thresh,
    )
    return arrays, scalars, constexprs


def _fold_axes(cfg: _Cfg, batch: int, bias: Any, aux: dict[str, Any]) -> tuple[Any, Any, Any]:
    """``fold_vmap`` axes of (the ``[B, ...]`` arrays, bias, aux): a vmapped call folds into the batch.

    A bias or mask broadcast over the batch (``[1, ...]`` against ``B > 1``) is shared (``None``), and
    so are the intervals and the seed: when vmap maps one of them, the call runs per element, as it
    does for a gradient summed over the batch (dBias of such a bias). With dropout nothing folds: the
    hash reads the batch index, so folded element ``v`` would draw row ``v * B + b``'s masks, not ``b``'s."""
    if cfg.dropout_prob > 0:
        return None, None, None

    def per_row(x: Any) -> int | None:
        return 0 if x is None or x.shape[0] == batch else None

    tables = per_row(aux["row_lo"])  # [B, T] per sequence (key lengths, prefix-LM), or [1, T] shared
    aux_axes = {**dict.fromkeys(aux, tables), "seed": None, "mask": per_row(aux["mask"]), "q_seg": 0, "kv_seg": 0}
    return 0, per_row(bias), aux_axes


def _forward(cfg: _Cfg, q: Any, k: Any, v: Any, bias: Any, aux: dict[str, Any]) -> tuple[jax.Array, jax.Array]:
    """``(o, lse)``: the forward kernel; under ``jax.vmap`` one launch over the folded batch (``_fold_axes``)."""
    rows, bias_axis, aux_axes = _fold_axes(cfg, q.shape[0], bias, aux)
    run = fold_vmap(functools.partial(_launch_forward, cfg), (rows, rows, rows, bias_axis, aux_axes), (rows, rows))
    return run(q, k, v, bias, aux)


def _launch_forward(
    cfg: _Cfg, q: Any, k: Any, v: Any, bias: Any, aux: dict[str, Any], out_dtype: Any = None
) -> tuple[jax.Array, jax.Array]:
    """``(o, lse)``; ``o`` in ``out_dtype`` (default ``q.dtype``; the attention block asks float32)."""
    kern, launch = _kernels(), _launch_module()
    b, t, h, d = q.shape
    dv = v.shape[-1]
    arrays, scalars, cx = _common(cfg, q, k, v, bias, aux)
    bias_a, mask_a, qseg_a, kseg_a, lo_a, hi_a = arrays
    bm, bn, warps, stages = cfg.fwd
    o, lse = launch.launch(
        kern._attn_fwd,
        q,
        k,
        v,
        bias_a,
        mask_a,
        qseg_a,
        kseg_a,
        lo_a,
        hi_a,
        aux["seed"],
        *scalars,
        out_shape=(
            jax.ShapeDtypeStruct((b, t, h, dv), out_dtype or q.dtype),
            jax.ShapeDtypeStruct((b, h, t), jnp.float32),
        ),
        grid=(cdiv(t, bm), h, b),
        num_warps=warps,
        num_stages=stages,
        name="ejkernel_flash_attention_fwd",
        BLOCK_M=bm,
        BLOCK_N=bn,
        HAS_BIAS=bias is not None,
        **cx,
    )
    return o, lse


def _bwd_delta(cfg: _Cfg, o: jax.Array, do: jax.Array) -> jax.Array:
    """The pre-pass ``delta = rowsum(dO * O)`` ``[B, H, T]`` float32."""
    kern, launch = _kernels(), _launch_module()
    b, t, h, dv = o.shape
    held = cfg.bwd[1]
    (delta,) = launch.launch(
        kern._attn_bwd_delta,
        o,
        do,
        int(t),
        out_shape=(jax.ShapeDtypeStruct((b, h, t), jnp.float32),),
        grid=(cdiv(t, held), h, b),
        num_warps=4,
        num_stages=1,
        name="ejkernel_flash_attention_bwd_delta",
        H=h,
        DV=dv,
        BLOCK_DV=_pow2(dv),
        BLOCK_M=held,
    )
    return delta


def _bwd_operands(
    cfg: _Cfg, res: tuple[Any, ...], do: jax.Array, delta: jax.Array
) -> tuple[tuple[Any, ...], tuple[Any, ...], list[Any], dict[str, Any]]:
    """What every backward kernel reads: the inputs with their masks and row intervals, then
    (seed, dO, lse, delta), the scalars and the constexprs."""
    q, k, v, bias, aux, o, lse = res
    arrays, scalars, cx = _common(cfg, q, k, v, bias, aux)
    return (q, k, v, *arrays), (aux["seed"], do, lse, delta), scalars, cx


def _bwd_dkdv(
    cfg: _Cfg, res: tuple[Any, ...], do: jax.Array, delta: jax.Array, out_dtype: Any = None
) -> tuple[jax.Array, jax.Array]:
    kern, launch = _kernels(), _launch_module()
    k, v, bias, aux = res[1:5]
    b, s, kh, _ = k.shape
    rows, grads, scalars, cx = _bwd_operands(cfg, res, do, delta)
    stream, held, warps, stages = cfg.bwd
    dk, dv = launch.launch(
        kern._attn_bwd_dkdv,
        *rows,
        aux["col_lo"],
        aux["col_hi"],
        *grads,
        *scalars,
        out_shape=(
            jax.ShapeDtypeStruct(k.shape, out_dtype or k.dtype),
            jax.ShapeDtypeStruct(v.shape, out_dtype or v.dtype),
        ),
        grid=(cdiv(s, held), kh, b),
        num_warps=warps,
        num_stages=stages,
        name="ejkernel_flash_attention_bwd_dkdv",
        BLOCK_M=stream,
        BLOCK_N=held,
        HAS_BIAS=bias is not None,
        **cx,
    )
    return dk, dv


def _bwd_dq(cfg: _Cfg, res: tuple[Any, ...], do: jax.Array, delta: jax.Array, out_dtype: Any = None) -> jax.Array:
    kern, launch = _kernels(), _launch_module()
    q, bias = res[0], res[3]
    b, t, h, _ = q.shape
    rows, grads, scalars, cx = _bwd_operands(cfg, res, do, delta)
    stream, held, warps, stages = cfg.bwd
    (dq,) = launch.launch(
        kern._attn_bwd_dq,
        *rows,
        *grads,
        *scalars,
        out_shape=(jax.ShapeDtypeStruct(q.shape, out_dtype or q.dtype),),
        grid=(cdiv(t, held), h, b),
        num_warps=warps,
        num_stages=stages,
        name="ejkernel_flash_attention_bwd_dq",
        BLOCK_M=held,
        BLOCK_N=stream,
        HAS_BIAS=bias is not None,
        **cx,
    )
    return dq


def _bwd_dbias(cfg: _Cfg, res: tuple[Any, ...], do: jax.Array, delta: jax.Array) -> jax.Array:
    kern, launch = _kernels(), _launch_module()
    q, k, bias = res[0], res[1], res[3]
    b, t, h, _ = q.shape
    s = k.shape[1]
    rows, grads, scalars, cx = _bwd_operands(cfg, res, do, delta)
    stream, held, warps, _ = cfg.bwd
    nb, nh = bias.shape[0], bias.shape[1]
    scalars.insert(3, int(b))  # the dBias kernel also takes B (it sums over a broadcast batch)
    (dbias,) = launch.launch(
        kern._attn_bwd_dbias,
        *rows,
        *grads,
        *scalars,
        out_shape=(jax.ShapeDtypeStruct(bias.shape, bias.dtype),),
        grid=(cdiv(t, held) * cdiv(s, stream), nh, nb),
        num_warps=warps,
        num_stages=1,
        name="ejkernel_flash_attention_bwd_dbias",
        BLOCK_M=held,
        BLOCK_N=stream,
        NBH=nh,
        BIAS_BCAST_B=(nb == 1 and b > 1),
        BIAS_BCAST_H=(nh == 1 and h > 1),
        **cx,
    )
    return dbias


def _backward(cfg: _Cfg, res: tuple[Any, ...], do: jax.Array) -> tuple[Any, Any, Any, Any]:
    """dQ, dK, dV, dBias (None without a bias) from the residuals ``(q, k, v, bias, aux, o, lse)``;
    under ``jax.vmap`` one set of launches over the folded batch (``_fold_axes``)."""
    rows, bias_axis, aux_axes = _fold_axes(cfg, res[0].shape[0], res[3], res[4])
    res_axes = (rows, rows, rows, bias_axis, aux_axes, rows, rows)
    run = fold_vmap(functools.partial(_launch_backward, cfg), (res_axes, rows), (rows, rows, rows, bias_axis))
    return run(res, do)


def _launch_backward(cfg: _Cfg, res: tuple[Any, ...], do: jax.Array) -> tuple[Any, Any, Any, Any]:
    """dQ, dK, dV, dBias (None without a bias): the delta pre-pass, then the dK/dV and dQ kernels.

    The tile rule (FA2): ``cfg.bwd = (q_blocksize, kv_blocksize, ...)`` names the dK/dV kernel's
    tiles, which holds ``kv_blocksize`` keys and streams ``q_blocksize`` queries; the dQ kernel
    takes the transpose, holding ``kv_blocksize`` queries and streaming ``q_blocksize`` keys. So
    ``kv_blocksize`` is the long held tile of both kernels and ``q_blocksize`` the short streamed
    one (the dBias kernel's tile is ``kv_blocksize`` queries by ``q_blocksize`` keys)."""
    q, bias = res[0], res[3]
    do = do.astype(q.dtype)
    delta = _bwd_delta(cfg, res[5], do)
    dk, dv = _bwd_dkdv(cfg, res, do, delta)
    dq = _bwd_dq(cfg, res, do, delta)
    dbias = _bwd_dbias(cfg, res, do, delta) if bias is not None else None
    return dq, dk, dv, dbias


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg: _Cfg, q: Any, k: Any, v: Any, bias: Any, aux: dict[str, Any]) -> jax.Array:
    return _forward(cfg, q, k, v, bias, aux)[0]


def _attention_fwd(
    cfg: _Cfg, q: Any, k: Any, v: Any, bias: Any, aux: dict[str, Any]
) -> tuple[jax.Array, tuple[Any, ...]]:
    o, lse = _forward(cfg, q, k, v, bias, aux)
    return o, (q, k, v, bias, aux, o, lse)


def _attention_bwd(cfg: _Cfg, res: tuple[Any, ...], do: jax.Array) -> tuple[Any, ...]:
    dq, dk, dv, dbias = _backward(cfg, res, do)
    return dq, dk, dv, dbias, None  # the aux arrays (masks, ids, intervals, seed) get no gradient


_attention.defvjp(_attention_fwd, _attention_bwd)


def _prepare(
    query: Any,
    key: Any,
    value: Any,
    bias: Any,
    *,
    attention_mask: Any,
    q_segment_ids: Any,
    kv_segment_ids: Any,
    softmax_scale: float | None,
    causal: bool,
    sliding_window: Any,
    logits_soft_cap: float | None,
    dropout_prob: float,
    dropout_seed: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    kv_lengths: Any,
    prefix_lengths: Any,
    fwd_params: Any,
    bwd_params: Any,
) -> tuple[_Cfg, dict[str, Any]]:
    b, t, h, d = query.shape
    s = key.shape[1]
    dv = value.shape[-1]
    e = np.dtype(query.dtype).itemsize
    if _launch_module().INTERPRET:
        small = (_INTERPRET_BLOCK, _INTERPRET_BLOCK, 4, 1)
        fwd_default = bwd_default = small
    else:
        x = _score_bytes(bias, attention_mask)
        fwd_default = _heuristic_tuple("fwd", d, dv, e, t, s, x)
        bwd_default = _heuristic_tuple("bwd", d, dv, e, t, s, x)
    cfg = _Cfg(
        scale=float(d**-0.5 if softmax_scale is None else softmax_scale),
        softcap=None if logits_soft_cap is None else float(logits_soft_cap),
        dropout_prob=float(dropout_prob),
        fwd=_resolve(fwd_params, fwd_default, "fwd_params"),
        bwd=_resolve(bwd_params, bwd_default, "bwd_params"),
    )
    row_lo, row_hi, col_lo, col_hi = mask_intervals(
        t,
        s,
        causal=causal,
        sliding_window=sliding_window,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        kv_lengths=kv_lengths,
        prefix_lengths=prefix_lengths,
    )
    if dropout_prob > 0:
        if isinstance(dropout_seed, int | np.integer):
            seed = jnp.asarray(np.asarray([int(dropout_seed) % 2**32], np.uint32))
        else:
            seed = jnp.reshape(jnp.asarray(dropout_seed).astype(jnp.uint32), (1,))
    else:
        seed = jnp.asarray(_DUMMY_U32)
    aux = dict(
        mask=None if attention_mask is None else jnp.asarray(attention_mask).astype(jnp.int8),
        q_seg=None if q_segment_ids is None else jnp.asarray(q_segment_ids).astype(jnp.int32),
        kv_seg=None if kv_segment_ids is None else jnp.asarray(kv_segment_ids).astype(jnp.int32),
        row_lo=row_lo,
        row_hi=row_hi,
        col_lo=col_lo,
        col_hi=col_hi,
        seed=seed,
    )
    return cfg, aux


def _forward_with_lse(query: Any, key: Any, value: Any, bias: Any = None, **kwargs: Any) -> tuple[jax.Array, jax.Array]:
    """Forward only, also returning the log-sum-exp ``[B, H, T]`` (float32, ``-inf`` on empty rows).
    Same keywords as :func:`flash_attention`; for tests and callers that need the statistics."""
    validate(query, key, value, bias, **kwargs)
    cfg, aux = _prepare(query, key, value, bias, **_with_defaults(kwargs))
    return _forward(cfg, query, key, value, bias, aux)


_DEFAULTS: dict[str, Any] = dict(
    attention_mask=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    softmax_scale=None,
    causal=False,
    sliding_window=None,
    logits_soft_cap=None,
    dropout_prob=0.0,
    dropout_seed=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    kv_lengths=None,
    prefix_lengths=None,
    fwd_params=None,
    bwd_params=None,
)


def _with_defaults(kwargs: dict[str, Any]) -> dict[str, Any]:
    unknown = set(kwargs) - set(_DEFAULTS)
    if unknown:
        raise TypeError(f"flash_attention: unexpected keyword(s) {sorted(unknown)}")
    return {**_DEFAULTS, **kwargs}


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
    kv_lengths: jax.Array | None = None,
    prefix_lengths: jax.Array | None = None,
    fwd_params: FwdParams | None = None,
    bwd_params: BwdParams | None = None,
) -> jax.Array:
    """Flash attention on Triton kernels; the semantics are those of
    ``ejkernel.modules.operations.flash_attention`` (read its module docstring).

    Differentiable in ``query``, ``key``, ``value`` and ``bias`` (``jax.custom_vjp``).
    ``fwd_params``/``bwd_params`` set the launches (``None`` fields: :func:`heuristic_cfg`'s values
    on GPU, 32x32 blocks in Triton's interpreter).
    """
    kwargs: dict[str, Any] = dict(
        attention_mask=attention_mask,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        softmax_scale=softmax_scale,
        causal=causal,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        dropout_prob=dropout_prob,
        dropout_seed=dropout_seed,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        kv_lengths=kv_lengths,
        prefix_lengths=prefix_lengths,
    )
    validate(query, key, value, bias, **kwargs)
    cfg, aux = _prepare(query, key, value, bias, fwd_params=fwd_params, bwd_params=bwd_params, **kwargs)
    return _attention(cfg, query, key, value, bias, aux)
