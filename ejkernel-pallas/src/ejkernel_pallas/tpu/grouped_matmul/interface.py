"""Mosaic TPU ``grouped_matmul`` (contract: ``ejkernel.modules.operations.grouped_matmul``).

The megablox design: ``gmm`` for the forward and for ``d lhs`` (the same grouped matmul against the
other orientation of ``rhs``), ``tgmm`` for ``d rhs[g] = lhs_g^T d out_g``; see ``_kernels``.
Serves float32 and bfloat16 (any ``transpose_rhs``, any ``preferred_element_type`` of those two); declines
float16, which the TPU does not compute in.

Launch parameters (``GmmParams`` in ``ejkernel_pallas.tpu.params``, one for the forward, one for both
backward kernels), in the op's letters (``lhs [M, K]``, ``out [M, N]``):

- ``block_m``: ``tm``, the row tile (a multiple of 128; all the rows, rounded up to 16, when fewer);
- ``block_n``: ``tn``, the tile of N (a multiple of 128, at most N rounded up to 128): the output
  columns of the forward and of ``d rhs``, the contracted dim of ``d lhs``;
- ``tk``, the tile of K, is no parameter: all of K (rounded up to 128) up to 1024 for bfloat16 (512 for
  float32: 2 KiB per row of a block), else the largest of 512, 256, 128 that divides K rounded up to 128
  (so that K is padded by less than 128). With ``tm = tn = 512`` the blocks, double-buffered, and the
  float32 accumulator stay under 16 MiB of VMEM (the default scoped limit of v4/v5e).

M, K and N are padded with zeros to tile multiples (a no-op for aligned shapes). Every product
accumulates in float32. The backward multiplies in the inputs' dtype: a float32 cotangent of bfloat16
inputs is rounded to bfloat16 per block, as the MXU takes it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from ejkernel.device import round_up
from ejkernel.modules.operations.grouped_matmul import canonical_dtype

from ejkernel_pallas.tpu.grouped_matmul._kernels import GmmGeometry, TgmmGeometry, gmm, schedule, tgmm
from ejkernel_pallas.tpu.params import GmmParams, coerce

SUPPORTED_DTYPES = ("float32", "bfloat16")
_LANES = 128
_SUBLANES = 16  # a bfloat16 vreg holds 16 rows
_TILES = (128, 256, 512)
_MAX_K_TILE_BYTES = 2048  # per row of a K block: all of K up to 1024 (bfloat16) or 512 (float32)


def supports(inv: Any) -> str | None:
    """``None`` when this kernel serves ``inv``, else the reason it does not."""
    a = inv.arguments
    dtype = str(np.dtype(a["lhs"].dtype))
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} (Mosaic TPU kernels take float32 or bfloat16)"
    out = canonical_dtype(a.get("preferred_element_type"))
    if out is not None and out not in SUPPORTED_DTYPES:
        return f"preferred_element_type {out} (Mosaic TPU kernels write float32 or bfloat16)"
    return None


def row_tile(m: int, wanted: int | None) -> int:
    """``tm``: ``wanted`` (default 128, 256 from 4096 rows, 512 from 16384) as a multiple of 128, or all the
    ``m`` rows rounded up to 16 when that is smaller."""
    if wanted is None:
        wanted = 128 if m < 4096 else 256 if m < 16384 else 512
    if not isinstance(wanted, int) or wanted < 1:
        raise ValueError(
            f"grouped_matmul (pallas:tpu): the row tile (GmmParams.block_m) must be a positive int, got {wanted!r}"
        )
    return min(round_up(wanted, _LANES), round_up(max(m, 1), _SUBLANES))


def col_tile(n: int, wanted: int | None) -> int:
    """``tn``: ``wanted`` (default: the largest of 512, 256, 128 dividing ``n`` rounded up to 128) as a multiple
    of 128, at most ``n`` rounded up to 128."""
    n128 = round_up(max(n, 1), _LANES)
    if wanted is None:
        wanted = next(t for t in reversed(_TILES) if n128 % t == 0)
    if not isinstance(wanted, int) or wanted < 1:
        raise ValueError(
            f"grouped_matmul (pallas:tpu): the N tile (GmmParams.block_n) must be a positive int, got {wanted!r}"
        )
    return min(round_up(wanted, _LANES), n128)


def k_tile(k: int, itemsize: int) -> int:
    """``tk``: all of ``k`` rounded up to 128 up to 2 KiB per row (1024 bfloat16, 512 float32), else the largest
    of 512, 256, 128 dividing it."""
    k128 = round_up(max(k, 1), _LANES)
    if k128 * itemsize <= _MAX_K_TILE_BYTES:
        return k128
    return next(t for t in reversed(_TILES) if k128 % t == 0)


def _dims(inv: Any) -> tuple[int, int]:
    a = inv.arguments
    m = int(a["lhs"].shape[0])
    n = int(a["rhs"].shape[1] if a.get("transpose_rhs") else a["rhs"].shape[2])
    return m, n


def heuristic_cfg(inv: Any, stage: str) -> GmmParams:
    m, n = _dims(inv)
    return GmmParams(block_m=row_tile(m, None), block_n=col_tile(n, None))


def candidate_cfgs(inv: Any, stage: str) -> list[GmmParams]:
    m, n = _dims(inv)
    out: list[GmmParams] = [heuristic_cfg(inv, stage)]
    for tm in _TILES:
        for tn in _TILES:
            cfg = GmmParams(block_m=row_tile(m, tm), block_n=col_tile(n, tn))
            if cfg not in out:
                out.append(cfg)
    return out


def _interpret_params() -> Any:
    """TPU interpret mode (on CPU, for tests); races are looked for when ``EJKERNEL_PALLAS_DETECT_RACES=1``."""
    import os

    return pltpu.InterpretParams(detect_races=os.environ.get("EJKERNEL_PALLAS_DETECT_RACES") == "1")


def _pad(x: jax.Array, sizes: tuple[int, ...]) -> jax.Array:
    if x.shape == sizes:
        return x
    return jnp.pad(x, [(0, s - d) for d, s in zip(x.shape, sizes, strict=True)])


def _grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    transpose_rhs: bool,
    out_dtype: str,
    fwd_params: GmmParams | None,
    bwd_params: GmmParams | None,
    interpret: Any,
) -> jax.Array:
    m, k = lhs.shape
    num_groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    if m == 0 or n == 0 or k == 0:  # nothing to multiply: zeros, and zero gradients through jnp.zeros
        return jnp.zeros((m, n), out_dtype)
    fwd_p = coerce(GmmParams, fwd_params) or GmmParams()
    bwd_p = coerce(GmmParams, bwd_params) or GmmParams()
    tk = k_tile(k, jnp.dtype(lhs.dtype).itemsize)
    k_pad = round_up(k, tk)

    def pad_rhs(r: jax.Array, n_pad: int) -> jax.Array:
        return _pad(r, (num_groups, n_pad, k_pad) if transpose_rhs else (num_groups, k_pad, n_pad))

    @jax.custom_vjp
    def run(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
        return fwd(lhs, rhs, group_sizes)[0]

    def fwd(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> Any:
        tm, tn = row_tile(m, fwd_p.block_m), col_tile(n, fwd_p.block_n)
        m_pad, n_pad = round_up(m, tm), round_up(n, tn)
        geo = GmmGeometry(tm=tm, tc=tk, to=tn, transpose_rhs=transpose_rhs, compute_dtype=lhs.dtype.name)
        sched = schedule(group_sizes, m, m_pad, tm, for_tgmm=False)
        out = gmm(geo, sched, _pad(lhs, (m_pad, k_pad)), pad_rhs(rhs, n_pad), out_dtype, interpret)
        return out[:m, :n], (lhs, rhs, group_sizes)

    def bwd(res: Any, dout: jax.Array) -> Any:
        lhs, rhs, group_sizes = res
        tm, tn = row_tile(m, bwd_p.block_m), col_tile(n, bwd_p.block_n)
        m_pad, n_pad = round_up(m, tm), round_up(n, tn)
        dtype = lhs.dtype.name
        dout_p = _pad(dout, (m_pad, n_pad))
        rhs_p = pad_rhs(rhs, n_pad)
        # d lhs = d out @ rhs[g]^T: gmm contracting N (tile tn), writing K (tile tk), rhs read the other way.
        geo_dlhs = GmmGeometry(tm=tm, tc=tn, to=tk, transpose_rhs=not transpose_rhs, compute_dtype=dtype)
        sched = schedule(group_sizes, m, m_pad, tm, for_tgmm=False)
        dlhs = gmm(geo_dlhs, sched, dout_p, rhs_p, dtype, interpret)[:m, :k]
        geo_drhs = TgmmGeometry(tm=tm, tk=tk, tn=tn, transpose_out=transpose_rhs, compute_dtype=dtype)
        sched = schedule(group_sizes, m, m_pad, tm, for_tgmm=True)
        drhs = tgmm(geo_drhs, sched, _pad(lhs, (m_pad, k_pad)), dout_p, num_groups, rhs.dtype.name, interpret)
        drhs = drhs[:, :n, :k] if transpose_rhs else drhs[:, :k, :n]
        return dlhs, drhs, np.zeros(group_sizes.shape, jax.dtypes.float0)

    run.defvjp(fwd, bwd)
    return run(lhs, rhs, group_sizes)


def _make(interpret: Any) -> Any:
    def grouped_matmul(
        lhs: jax.Array,
        rhs: jax.Array,
        group_sizes: jax.Array,
        *,
        transpose_rhs: bool = False,
        preferred_element_type: Any = None,
        fwd_params: GmmParams | None = None,
        bwd_params: GmmParams | None = None,
    ) -> jax.Array:
        """Mosaic TPU grouped matmul; launch parameters ``GmmParams``: ``block_m`` (rows) and ``block_n`` (N)."""
        return _grouped_matmul(
            lhs,
            rhs,
            group_sizes,
            transpose_rhs=bool(transpose_rhs),
            out_dtype=canonical_dtype(preferred_element_type) or jnp.dtype(lhs.dtype).name,
            fwd_params=fwd_params,
            bwd_params=bwd_params,
            interpret=interpret() if callable(interpret) else interpret,
        )

    return grouped_matmul


grouped_matmul = _make(False)
"""On a TPU: compiled by Mosaic."""
grouped_matmul_interpret = _make(_interpret_params)
"""On a CPU: the same kernels in JAX's TPU interpret mode (tests; slow)."""

__all__ = ["candidate_cfgs", "grouped_matmul", "grouped_matmul_interpret", "heuristic_cfg", "supports"]
