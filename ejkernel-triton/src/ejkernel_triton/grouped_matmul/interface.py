"""Grouped matmul (contract: ``ejkernel.modules.operations.grouped_matmul``) on the Triton kernels of ``_kernels``.

Shapes: M rows, K contraction dim, N output columns, G groups.

Forward: ``gmm(lhs, rhs)``. Backward (``jax.custom_vjp``, residuals: the inputs): ``d lhs = gmm(d out, rhs^T)``
(the same kernel reading ``rhs`` through the other strides) and ``d rhs = tgmm(lhs, d out)`` (with
``transpose_rhs``: ``tgmm(d out, lhs)``, which writes ``[G, N, K]`` directly); ``group_sizes`` gets no gradient.

The tile schedule of ``gmm`` (which part of which row tile belongs to which group) is computed from
``group_sizes`` by a few XLA ops on the device (:func:`_schedule`): no host sync, so the call works under
``jit`` with traced group sizes. Groups are cut at M, rows past ``sum(group_sizes)`` are written as zeros.

Float32 inputs use full-precision float32 dots (not tf32); bfloat16 and float16 use tensor cores. Every
product accumulates in float32. The backward multiplies in the inputs' dtype (a float32 cotangent of
bfloat16 inputs is rounded to bfloat16 first, as the tensor cores take it).

Launch parameters: :class:`GmmFwdParams` (forward) and :class:`GmmBwdParams` (both backward kernels, each
with its own tiles). Importing this module does not import Triton (the kernels load on the first call).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.device import cdiv, first_gpu, next_power_of_2, shared_memory_per_block
from ejkernel.kernels.params import MappedParams, check_positive, coerce
from ejkernel.modules.operations.grouped_matmul import canonical_dtype, validate

__all__ = ["GmmBwdParams", "GmmFwdParams", "candidate_cfgs", "grouped_matmul", "heuristic_cfg", "supports"]

_DTYPES = ("float32", "bfloat16", "float16")
_DEFAULT_SMS = 132  # an H200's: what the heuristics target where no GPU is visible


# ------------------------------------------------------------------------------------------------
# Launch parameters.
# ------------------------------------------------------------------------------------------------


def _check_tiles(params: Any, prefix: str = "") -> None:
    for name in ("block_m", "block_n", "block_k"):
        check_positive(params, prefix + name, power_of_two=True, within=(16, 512))
    check_positive(params, prefix + "num_warps", power_of_two=True, within=(1, 16))
    check_positive(params, prefix + "num_stages", within=(1, 8))


@dataclasses.dataclass(frozen=True)
class GmmFwdParams(MappedParams):
    """Launch parameters of the forward ``gmm`` (``lhs [M, K] x rhs[g] [K, N]``).

    ``block_m``, ``block_n``, ``block_k``: the tiles of M, N and K, powers of two from 16 to 512 (used up to
    the dims rounded up to powers of two); ``group_m``: row tiles per band of the L2-friendly program order
    (1 to 64); ``num_warps`` (a power of two up to 16), ``num_stages`` (pipelined K steps, 1 to 8). None: the
    heuristic's. Generic ``q_blocksize``/``kv_blocksize``/``num_warps``/``num_stages`` map to
    ``block_m``/``block_n``/``num_warps``/``num_stages``.

    >>> GmmFwdParams(block_m=128, block_n=96)
    Traceback (most recent call last):
    ValueError: GmmFwdParams.block_n must be a power of two from 16 to 512 or None, got 96
    """

    GENERIC: ClassVar[dict[str, str]] = {
        "q_blocksize": "block_m",
        "kv_blocksize": "block_n",
        "num_warps": "num_warps",
        "num_stages": "num_stages",
    }
    block_m: int | None = None
    block_n: int | None = None
    block_k: int | None = None
    group_m: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_tiles(self)
        check_positive(self, "group_m", within=(1, 64))


@dataclasses.dataclass(frozen=True)
class GmmBwdParams(MappedParams):
    """Launch parameters of the backward: ``d lhs`` (a ``gmm`` ``d out [M, N] x rhs[g]^T [N, K]``) and ``d rhs``
    (``tgmm``: per group ``lhs^T d out``, ``[K, N]``), tuned separately.

    ``d lhs``: ``block_m`` (rows), ``block_n`` (its output columns, K), ``block_k`` (its contraction, N),
    ``group_m``, ``num_warps``, ``num_stages``, as :class:`GmmFwdParams`'s. ``d rhs``: ``tgmm_block_m`` (rows
    per step of the reduction over a group), ``tgmm_block_k``/``tgmm_block_n`` (the tile of ``d rhs[g]``
    along K and N), ``tgmm_num_warps``, ``tgmm_num_stages``. None: the heuristic's. Generic
    ``q_blocksize``/``kv_blocksize``/``num_warps``/``num_stages`` map to the ``d lhs`` fields.
    """

    GENERIC: ClassVar[dict[str, str]] = GmmFwdParams.GENERIC
    block_m: int | None = None
    block_n: int | None = None
    block_k: int | None = None
    group_m: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    tgmm_block_m: int | None = None
    tgmm_block_k: int | None = None
    tgmm_block_n: int | None = None
    tgmm_num_warps: int | None = None
    tgmm_num_stages: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_tiles(self)
        check_positive(self, "group_m", within=(1, 64))
        _check_tiles(self, "tgmm_")


# ------------------------------------------------------------------------------------------------
# Heuristics and candidates.
# ------------------------------------------------------------------------------------------------


def _interpreting() -> bool:
    """Whether the kernels will run in Triton's interpreter (from the environment: Triton stays unimported)."""
    if os.environ.get("EJKERNEL_TRITON_INTERPRET") == "1":
        return True
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _smem_bytes() -> int:
    """Opt-in shared memory per block of the local GPU; without one, Hopper's (what the configs target)."""
    gpu = first_gpu()
    return (gpu and gpu.shared_memory_per_block) or shared_memory_per_block((9, 0))


def _hopper() -> bool:
    gpu = first_gpu()
    return gpu is None or gpu.has_capability(9, 0)


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, next_power_of_2(n))


@dataclasses.dataclass(frozen=True)
class _Problem:
    m: int
    k: int
    n: int
    g: int
    itemsize: int


def _problem(invocation: Any) -> _Problem:
    args = getattr(invocation, "arguments", invocation)
    if not isinstance(args, Mapping):
        raise TypeError(f"expected an invocation with an .arguments mapping, got {type(invocation).__name__}")
    lhs, rhs = args["lhs"], args["rhs"]
    n = rhs.shape[1] if args.get("transpose_rhs") else rhs.shape[2]
    return _Problem(int(lhs.shape[0]), int(lhs.shape[1]), int(n), int(rhs.shape[0]), np.dtype(lhs.dtype).itemsize)


# (block_m, block_n, block_k, group_m, warps, stages) of a gmm / (block_m, block_k, block_n, warps, stages) of a
# tgmm, before they are fitted to the problem and the device.
_Gmm = tuple[int, int, int, int, int, int]
_Tgmm = tuple[int, int, int, int, int]


def _gmm_smem(t: _Gmm, e: int) -> int:
    bm, bn, bk, _, _, stages = t
    return e * stages * (bm * bk + bk * bn)


def _tgmm_smem(t: _Tgmm, e: int) -> int:
    bm, bk, bn, _, stages = t
    return e * stages * bm * (bk + bn)


def _fit_gmm(t: _Gmm, rows: int, out_cols: int, contract: int, e: int) -> _Gmm:
    """``t`` with tiles no longer than the (power-of-two rounded) dims, then fewer stages or smaller tiles until
    the shared memory fits and the float32 accumulator stays near 128 registers a thread."""
    bm, bn, bk, gm, warps, stages = t
    bm, bn, bk = min(bm, _pow2(rows)), min(bn, _pow2(out_cols)), min(bk, _pow2(contract))
    while _gmm_smem((bm, bn, bk, gm, warps, stages), e) > _smem_bytes() or bm * bn > 128 * 32 * warps:
        if stages > 2:
            stages -= 1
        elif bn > 16 and bn >= bm:
            bn //= 2
        elif bm > 16:
            bm //= 2
        elif bk > 16:
            bk //= 2
        else:
            break
    return bm, bn, bk, gm, warps, stages


def _fit_tgmm(t: _Tgmm, rows: int, p: int, q: int, e: int) -> _Tgmm:
    bm, bk, bn, warps, stages = t
    bm, bk, bn = min(bm, _pow2(rows)), min(bk, _pow2(p)), min(bn, _pow2(q))
    while _tgmm_smem((bm, bk, bn, warps, stages), e) > _smem_bytes() or bk * bn > 128 * 32 * warps:
        if stages > 2:
            stages -= 1
        elif bn > 16 and bn >= bk:
            bn //= 2
        elif bk > 16:
            bk //= 2
        elif bm > 16:
            bm //= 2
        else:
            break
    return bm, bk, bn, warps, stages


def _gmm_default(pb: _Problem, rows: int, out_cols: int, contract: int) -> _Gmm:
    """Hopper: 128 x 256 x 64 tiles, 8 warps, 3 stages for 16-bit inputs (128 x 128 x 32 for float32, whose
    dots run on FMA units); a 64-row tile when the mean group is shorter than 128 rows (a tile that
    straddles a boundary is computed once per group it meets). Older GPUs: 128 x 128 x 32, 4 warps."""
    if _interpreting():
        return _fit_gmm((32, 32, 32, 4, 4, 1), rows, out_cols, contract, pb.itemsize)
    bm = 128 if rows >= 128 * pb.g else 64
    if pb.itemsize > 2:
        t = (bm, 128, 32, 8, 8, 3)
    elif _hopper():
        t = (bm, 256, 64, 8, 8, 3)
    else:
        t = (bm, 128, 32, 8, 4, 3)
    return _fit_gmm(t, rows, out_cols, contract, pb.itemsize)


def _tgmm_default(pb: _Problem, p: int, q: int) -> _Tgmm:
    """``d rhs``'s tiles: 128 x 256 of ``d rhs[g]``, 64 rows per step, 8 warps, 3 stages (16-bit inputs, Hopper)."""
    if _interpreting():
        return _fit_tgmm((32, 32, 32, 4, 1), pb.m, p, q, pb.itemsize)
    if pb.itemsize > 2:
        t = (32, 128, 128, 8, 3)
    elif _hopper():
        t = (64, 128, 256, 8, 3)
    else:
        t = (32, 128, 128, 4, 3)
    return _fit_tgmm(t, pb.m, p, q, pb.itemsize)


def heuristic_cfg(invocation: Any, stage: str = "fwd") -> GmmFwdParams | GmmBwdParams:
    """The default launch parameters of ``stage`` ("fwd" or "bwd") for this call."""
    pb = _problem(invocation)
    if stage == "fwd":
        bm, bn, bk, gm, w, s = _gmm_default(pb, pb.m, pb.n, pb.k)
        return GmmFwdParams(block_m=bm, block_n=bn, block_k=bk, group_m=gm, num_warps=w, num_stages=s)
    bm, bn, bk, gm, w, s = _gmm_default(pb, pb.m, pb.k, pb.n)
    tm, tk, tn, tw, ts = _tgmm_default(pb, pb.k, pb.n)
    return GmmBwdParams(
        block_m=bm,
        block_n=bn,
        block_k=bk,
        group_m=gm,
        num_warps=w,
        num_stages=s,
        tgmm_block_m=tm,
        tgmm_block_k=tk,
        tgmm_block_n=tn,
        tgmm_num_warps=tw,
        tgmm_num_stages=ts,
    )


# Shapes worth timing: tiles of the GEMMs that run near peak on Hopper, each fitted to the call (duplicates
# dropped). Every one costs a Triton compile when the autotuner times it, so the lists stay short.
_GMM_CANDIDATES: tuple[_Gmm, ...] = (
    (128, 256, 64, 8, 8, 3),
    (128, 256, 64, 8, 8, 4),
    (128, 128, 64, 8, 4, 4),
    (128, 128, 64, 8, 8, 4),
    (64, 256, 64, 8, 8, 4),
    (64, 128, 64, 8, 4, 4),
    (256, 128, 64, 8, 8, 3),
)
_TGMM_CANDIDATES: tuple[_Tgmm, ...] = (
    (64, 128, 256, 8, 3),
    (64, 128, 128, 4, 4),
    (64, 128, 128, 8, 4),
    (32, 128, 256, 8, 4),
    (64, 256, 128, 8, 3),
)


def candidate_cfgs(invocation: Any, stage: str = "fwd") -> list[GmmFwdParams | GmmBwdParams]:
    """Launch parameters worth timing for ``stage``, the heuristic's first; each fitted to the call and the
    device's shared memory. The backward pairs the ``d lhs`` and ``d rhs`` candidates index by index (the
    autotuner times the two together)."""
    pb = _problem(invocation)
    e = pb.itemsize
    heuristic = heuristic_cfg(invocation, stage)
    if stage == "fwd":
        fits = [_fit_gmm(t, pb.m, pb.n, pb.k, e) for t in _GMM_CANDIDATES]
        out: list[GmmFwdParams | GmmBwdParams] = [heuristic]
        for bm, bn, bk, gm, w, s in dict.fromkeys(fits):
            p = GmmFwdParams(block_m=bm, block_n=bn, block_k=bk, group_m=gm, num_warps=w, num_stages=s)
            if p not in out:
                out.append(p)
        return out
    dlhs = list(dict.fromkeys(_fit_gmm(t, pb.m, pb.k, pb.n, e) for t in _GMM_CANDIDATES))
    drhs = list(dict.fromkeys(_fit_tgmm(t, pb.m, pb.k, pb.n, e) for t in _TGMM_CANDIDATES))
    out = [heuristic]
    for i in range(max(len(dlhs), len(drhs))):
        bm, bn, bk, gm, w, s = dlhs[min(i, len(dlhs) - 1)]
        tm, tk, tn, tw, ts = drhs[min(i, len(drhs) - 1)]
        bp = GmmBwdParams(
            block_m=bm,
            block_n=bn,
            block_k=bk,
            group_m=gm,
            num_warps=w,
            num_stages=s,
            tgmm_block_m=tm,
            tgmm_block_k=tk,
            tgmm_block_n=tn,
            tgmm_num_warps=tw,
            tgmm_num_stages=ts,
        )
        if bp not in out:
            out.append(bp)
    return out


def supports(invocation: Any) -> str | None:
    """None when the Triton kernels can run this call, else why not."""
    args = getattr(invocation, "arguments", invocation)
    dtype = np.dtype(args["lhs"].dtype).name
    if dtype not in _DTYPES:
        return f"ejkernel-triton grouped_matmul: dtype {dtype} is not supported (float32, bfloat16, float16)"
    out = canonical_dtype(args.get("preferred_element_type"))
    if out is not None and out not in _DTYPES:
        return f"ejkernel-triton grouped_matmul: preferred_element_type {out} is not supported"
    if importlib.util.find_spec("triton") is None:  # find, don't import: see ejkernel_triton.launch
        return "ejkernel-triton grouped_matmul: triton is not installed"
    return None


# ------------------------------------------------------------------------------------------------
# The device-side schedule and the launches.
# ------------------------------------------------------------------------------------------------


def num_items(m: int, g: int, block_m: int) -> int:
    """The static bound on ``gmm``'s work items: each of the G boundaries between the G + 1 segments (the
    groups, then the rows in no group) inside a row tile adds one item to the ``cdiv(M, block_m)`` tiles."""
    return cdiv(m, block_m) + g


def _schedule(group_sizes: jax.Array, m: int, block_m: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``gmm``'s work items, sorted by segment then row tile: ``group [W]`` (-1: the rows past
    ``sum(group_sizes)``, written as zeros), ``lo [W]``, ``hi [W]`` (the item's rows; ``lo == hi`` past the real
    items). XLA ops on the device: traced ``group_sizes`` are fine. Groups are cut at M."""
    g = group_sizes.shape[0]
    w = num_items(m, g, block_m)
    ends = jnp.clip(jnp.cumsum(group_sizes.astype(jnp.int32)), 0, m)
    seg_end = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
    seg_start = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])
    seg_group = jnp.concatenate([jnp.arange(g, dtype=jnp.int32), jnp.full((1,), -1, jnp.int32)])
    tiles = jnp.where(seg_end > seg_start, (seg_end - 1) // block_m - seg_start // block_m + 1, 0)
    first = jnp.cumsum(tiles) - tiles
    item = jnp.arange(w, dtype=jnp.int32)
    seg = jnp.repeat(jnp.arange(g + 1, dtype=jnp.int32), tiles, total_repeat_length=w)
    tile = seg_start[seg] // block_m + item - first[seg]
    valid = item < jnp.sum(tiles)
    lo = jnp.maximum(tile * block_m, seg_start[seg])
    hi = jnp.minimum(tile * block_m + block_m, seg_end[seg])
    return seg_group[seg], jnp.where(valid, lo, 0), jnp.where(valid, hi, 0)


def _kernels() -> Any:
    from ejkernel_triton.grouped_matmul import _kernels as k

    return k


def _launch_module() -> Any:
    from ejkernel_triton import launch

    return launch


def _gmm(
    a: jax.Array, b: jax.Array, group_sizes: jax.Array, *, b_transposed: bool, out_dtype: Any, tiles: _Gmm, what: str
) -> jax.Array:
    """``out[i] = a[i] @ B[g(i)]`` ``[M, NO]``: ``B[g]`` is ``b[g]`` (``[G, KC, NO]``) or, ``b_transposed``, ``b[g]^T``
    (``b`` is ``[G, NO, KC]``)."""
    m, kc = a.shape
    g = b.shape[0]
    no = b.shape[1] if b_transposed else b.shape[2]
    bm, bn, bk, gm, warps, stages = tiles
    group, lo, hi = _schedule(group_sizes, m, bm)
    w = num_items(m, g, bm)
    stride_c, stride_o = (1, kc) if b_transposed else (no, 1)
    (out,) = _launch_module().launch(
        _kernels()._gmm_kernel,
        a,
        b,
        group,
        lo,
        hi,
        int(m),
        int(w),
        out_shape=(jax.ShapeDtypeStruct((m, no), out_dtype),),
        grid=(w * cdiv(no, bn),),
        num_warps=warps,
        num_stages=stages,
        name=f"ejkernel_grouped_matmul_{what}",
        KC=kc,
        NO=no,
        STRIDE_BG=kc * no,
        STRIDE_BC=stride_c,
        STRIDE_BO=stride_o,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP_M=gm,
    )
    return out


def _tgmm(x: jax.Array, y: jax.Array, group_sizes: jax.Array, *, out_dtype: Any, tiles: _Tgmm) -> jax.Array:
    """``d[g] = x[rows of g]^T @ y[rows of g]`` ``[G, P, Q]`` (zeros for an empty group)."""
    m, p = x.shape
    q = y.shape[1]
    g = group_sizes.shape[0]
    bm, bp, bq, warps, stages = tiles
    ends = jnp.clip(jnp.cumsum(group_sizes.astype(jnp.int32)), 0, m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    (d,) = _launch_module().launch(
        _kernels()._tgmm_kernel,
        x,
        y,
        starts,
        ends,
        out_shape=(jax.ShapeDtypeStruct((g, p, q), out_dtype),),
        grid=(g * cdiv(p, bp) * cdiv(q, bq),),
        num_warps=warps,
        num_stages=stages,
        name="ejkernel_grouped_matmul_tgmm",
        P=p,
        Q=q,
        BLOCK_M=bm,
        BLOCK_P=bp,
        BLOCK_Q=bq,
    )
    return d


@dataclasses.dataclass(frozen=True)
class _Cfg:
    """Everything static about one call: the custom_vjp's non-differentiable argument."""

    transpose_rhs: bool
    out_dtype: str
    fwd: _Gmm
    dlhs: _Gmm
    drhs: _Tgmm


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _grouped_matmul(cfg: _Cfg, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    return _gmm(
        lhs, rhs, group_sizes, b_transposed=cfg.transpose_rhs, out_dtype=cfg.out_dtype, tiles=cfg.fwd, what="fwd"
    )


def _fwd(cfg: _Cfg, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> tuple[jax.Array, Any]:
    return _grouped_matmul(cfg, lhs, rhs, group_sizes), (lhs, rhs, group_sizes)


def _bwd(cfg: _Cfg, res: Any, dout: jax.Array) -> tuple[Any, ...]:
    lhs, rhs, group_sizes = res
    dout = dout.astype(lhs.dtype)
    # d lhs[i] = d out[i] @ rhs[g(i)]^T: rhs read the other way round
    dlhs = _gmm(
        dout, rhs, group_sizes, b_transposed=not cfg.transpose_rhs, out_dtype=lhs.dtype, tiles=cfg.dlhs, what="dlhs"
    )
    if cfg.transpose_rhs:  # d rhs[g] = d out_g^T lhs_g, [N, K]
        drhs = _tgmm(dout, lhs, group_sizes, out_dtype=rhs.dtype, tiles=cfg.drhs)
    else:  # d rhs[g] = lhs_g^T d out_g, [K, N]
        drhs = _tgmm(lhs, dout, group_sizes, out_dtype=rhs.dtype, tiles=cfg.drhs)
    return dlhs, drhs, np.zeros(group_sizes.shape, jax.dtypes.float0)


_grouped_matmul.defvjp(_fwd, _bwd)


def _pick(params: Any, names: tuple[str, ...], default: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(
        d if params is None or getattr(params, f) is None else int(getattr(params, f)) for f, d in zip(names, default)
    )


_GMM_FIELDS = ("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages")
_TGMM_FIELDS = ("tgmm_block_m", "tgmm_block_k", "tgmm_block_n", "tgmm_num_warps", "tgmm_num_stages")


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    transpose_rhs: bool = False,
    preferred_element_type: Any = None,
    fwd_params: GmmFwdParams | None = None,
    bwd_params: GmmBwdParams | None = None,
) -> jax.Array:
    """Grouped matmul on Triton kernels; the semantics are ``ejkernel.modules.operations.grouped_matmul``'s.

    Differentiable in ``lhs`` and ``rhs`` (``jax.custom_vjp``). ``fwd_params``/``bwd_params``: this module's
    :class:`GmmFwdParams`/:class:`GmmBwdParams` (or the generic ``FwdParams``/``BwdParams``, mapped); ``None``
    fields take :func:`heuristic_cfg`'s values.
    """
    validate(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, preferred_element_type=preferred_element_type)
    fwd_p = coerce(GmmFwdParams, fwd_params)
    bwd_p = coerce(GmmBwdParams, bwd_params)
    m, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    out_dtype = canonical_dtype(preferred_element_type) or np.dtype(lhs.dtype).name
    if m == 0 or n == 0 or k == 0:  # nothing to multiply: zeros, and zero gradients through jnp.zeros
        return jnp.zeros((m, n), out_dtype)
    pb = _Problem(m, k, n, rhs.shape[0], np.dtype(lhs.dtype).itemsize)
    cfg = _Cfg(
        transpose_rhs=bool(transpose_rhs),
        out_dtype=out_dtype,
        fwd=_pick(fwd_p, _GMM_FIELDS, _gmm_default(pb, m, n, k)),  # type: ignore[arg-type]
        dlhs=_pick(bwd_p, _GMM_FIELDS, _gmm_default(pb, m, k, n)),  # type: ignore[arg-type]
        drhs=_pick(bwd_p, _TGMM_FIELDS, _tgmm_default(pb, k, n)),  # type: ignore[arg-type]
    )
    return _grouped_matmul(cfg, lhs, rhs, group_sizes)
