"""Mosaic TPU flash attention kernels: forward, dK/dV and dQ (+ dBias), one ``pallas_call`` each.

Layout: heads lead, ``q [B, H, Tp, D]``, ``k/v [B, K, Sp, D]`` with ``Tp``/``Sp`` padded to block
multiples (padded keys are masked, padded query rows sliced off by the caller). Query head ``h``
reads kv head ``h // G``, ``G = H // K``, through the index maps: keys are never repeated in memory.

Grids put the reduction axis last and mark it ``arbitrary``; the others are ``parallel`` so that a
megacore chip splits them over its cores. Block visibility (causal / sliding window) is decided per
grid step: an invisible step does no work, and for causal calls the key/value index maps clamp to the
last visible block, so that the pipeline re-uses the resident block instead of fetching a new one.

Running statistics live in VMEM scratch replicated over the 128 lanes (the TPU's natural layout
for a per-row value).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

F32 = jnp.float32
LANES = 128


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Static description of one call: true and padded lengths, blocks, masking options."""

    t: int  # query length
    s: int  # key length
    bq: int
    bk: int
    group: int  # query heads per kv head
    scale: float
    causal: bool
    window: tuple[int, int] | None
    soft_cap: float | None
    has_bias: bool
    bias_batch: bool  # bias has a batch dim of size B (else broadcast)
    bias_heads: bool
    has_segments: bool

    @property
    def offset(self) -> int:
        return self.s - self.t  # bottom-right alignment: query i sits at key position i + S - T

    def visible(self, iq: Any, ik: Any) -> Any:
        """Whether query block ``iq`` and key block ``ik`` share at least one admitted pair (a traced bool)."""
        first_row, last_row = iq * self.bq, iq * self.bq + self.bq - 1
        first_col, last_col = ik * self.bk, ik * self.bk + self.bk - 1
        ok = first_col < self.s
        if self.causal:
            ok &= first_col <= last_row + self.offset
        if self.window is not None:
            left, right = self.window
            ok &= last_col >= first_row + self.offset - left
            ok &= first_col <= last_row + self.offset + right
        return ok

    def last_visible_kv_block(self, iq: Any) -> Any:
        """For causal calls: the highest key block query block ``iq`` sees (index maps clamp to it)."""
        last_col = iq * self.bq + self.bq - 1 + self.offset
        if self.window is not None:
            last_col = last_col + self.window[1]
        n = -(-self.s // self.bk)
        return jnp.clip(last_col // self.bk, 0, n - 1)

    def first_visible_q_block(self, ik: Any) -> Any:
        """For causal calls: the lowest query block that sees key block ``ik`` (index maps clamp to it)."""
        first_row = ik * self.bk - self.offset
        if self.window is not None:
            first_row = first_row - self.window[1]
        n = -(-self.t // self.bq)
        return jnp.clip(first_row // self.bq, 0, n - 1)

    def scores(self, q: Any, k: Any, bias: Any, qseg: Any, kseg: Any, iq: Any, ik: Any) -> tuple[Any, Any, Any]:
        """Scores of one tile: ``(s, mask, capped)``; ``s`` is soft-capped and masked to ``-inf``;
        ``capped`` is ``tanh(raw / cap)`` (for the backward's chain rule) or ``None``."""
        raw = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=F32) * self.scale
        if bias is not None:
            raw = raw + bias.astype(F32)
        capped = None
        if self.soft_cap is not None:
            capped = jnp.tanh(raw / self.soft_cap)
            raw = self.soft_cap * capped
        rows = iq * self.bq + lax.broadcasted_iota(jnp.int32, raw.shape, 0)
        cols = ik * self.bk + lax.broadcasted_iota(jnp.int32, raw.shape, 1)
        mask = cols < self.s
        if self.causal:
            mask &= cols <= rows + self.offset
        if self.window is not None:
            left, right = self.window
            mask &= (cols >= rows + self.offset - left) & (cols <= rows + self.offset + right)
        if qseg is not None:
            mask &= qseg == kseg  # [bq, 1] == [1, bk]
        return jnp.where(mask, raw, -jnp.inf), mask, capped


def _split_refs(geo: Geometry, refs: tuple[Any, ...], n_inputs: int) -> tuple[dict[str, Any], tuple[Any, ...]]:
    """Name the optional input refs (bias, segment ids) that follow the fixed ones."""
    names = list(refs[:n_inputs])
    named: dict[str, Any] = {"bias": None, "qseg": None, "kseg": None}
    if geo.has_bias:
        named["bias"] = names.pop(0)
    if geo.has_segments:
        named["qseg"], named["kseg"] = names.pop(0), names.pop(0)
    return named, refs[n_inputs:]


def _tile_extras(named: dict[str, Any]) -> tuple[Any, Any, Any]:
    bias = None if named["bias"] is None else named["bias"][0, 0]
    qseg = None if named["qseg"] is None else named["qseg"][0]
    kseg = None if named["kseg"] is None else named["kseg"][0]
    return bias, qseg, kseg


def _n_optional(geo: Geometry) -> int:
    return int(geo.has_bias) + 2 * int(geo.has_segments)


# ----------------------------------------------------------------------------------------- forward


def _fwd_kernel(geo: Geometry, q_ref: Any, k_ref: Any, v_ref: Any, *refs: Any) -> None:
    named, (o_ref, lse_ref, m_sc, l_sc, acc_sc) = _split_refs(geo, refs, _n_optional(geo))
    iq, ik = pl.program_id(2), pl.program_id(3)

    @pl.when(ik == 0)
    def _init() -> None:
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, F32)
        l_sc[...] = jnp.zeros(l_sc.shape, F32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, F32)

    @pl.when(geo.visible(iq, ik))
    def _step() -> None:
        bias, qseg, kseg = _tile_extras(named)
        s, mask, _ = geo.scores(q_ref[0, 0], k_ref[0, 0], bias, qseg, kseg, iq, ik)
        m_prev = m_sc[:, :1]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row with nothing admitted yet stays at 0
        p = jnp.where(mask, jnp.exp(s - m_safe), 0.0)
        alpha = jnp.exp(m_prev - m_safe)
        l_sc[...] = jnp.broadcast_to(alpha * l_sc[:, :1] + jnp.sum(p, axis=1, keepdims=True), l_sc.shape)
        v = v_ref[0, 0]
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=F32)
        acc_sc[...] = alpha * acc_sc[...] + pv
        m_sc[...] = jnp.broadcast_to(m_new, m_sc.shape)

    @pl.when(ik == pl.num_programs(3) - 1)
    def _finish() -> None:
        l = l_sc[:, :1]
        has = l > 0
        o_ref[0, 0] = jnp.where(has, acc_sc[...] / jnp.where(has, l, 1.0), 0.0).astype(o_ref.dtype)
        lse_ref[0, 0] = jnp.where(has, m_sc[:, :1] + jnp.log(jnp.where(has, l, 1.0)), -jnp.inf)


def _extra_specs(geo: Geometry, q_index: Any, k_index: Any) -> list[Any]:
    """Block specs of the optional inputs, given functions from grid indices to (query block, key block)."""
    specs = []
    if geo.has_bias:

        def bias_map(b: Any, h: Any, *ij: Any) -> Any:
            return (b if geo.bias_batch else 0, h if geo.bias_heads else 0, q_index(b, h, *ij), k_index(b, h, *ij))

        specs.append(pl.BlockSpec((1, 1, geo.bq, geo.bk), bias_map))
    if geo.has_segments:
        specs.append(pl.BlockSpec((1, geo.bq, 1), lambda b, h, *ij: (b, q_index(b, h, *ij), 0)))
        specs.append(pl.BlockSpec((1, 1, geo.bk), lambda b, h, *ij: (b, 0, k_index(b, h, *ij))))
    return specs


def _compiler_params(interpret: Any) -> Any:
    if interpret:
        # JAX's TPU interpreter does not extend dimension_semantics by the grid axes that vmap prepends
        # (Mosaic's lowering does), so interpreted kernels leave them unset: every axis sequential.
        return pltpu.CompilerParams()
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))


def forward(geo: Geometry, q: Any, k: Any, v: Any, extras: Any, interpret: Any) -> Any:
    """``(o [B, H, Tp, Dv], lse [B, H, Tp, 1] float32)`` of padded, head-leading inputs."""
    b, h, tp, d = q.shape
    sp, dv = k.shape[2], v.shape[3]
    grid = (b, h, tp // geo.bq, sp // geo.bk)

    def kv_block(bi: Any, hi: Any, i: Any, j: Any) -> Any:
        return jnp.minimum(j, geo.last_visible_kv_block(i)) if geo.causal else j

    in_specs = [
        pl.BlockSpec((1, 1, geo.bq, d), lambda bi, hi, i, j: (bi, hi, i, 0)),
        pl.BlockSpec((1, 1, geo.bk, d), lambda bi, hi, i, j: (bi, hi // geo.group, kv_block(bi, hi, i, j), 0)),
        pl.BlockSpec((1, 1, geo.bk, dv), lambda bi, hi, i, j: (bi, hi // geo.group, kv_block(bi, hi, i, j), 0)),
        *_extra_specs(geo, lambda bi, hi, i, j: i, kv_block),
    ]
    return pl.pallas_call(
        functools.partial(_fwd_kernel, geo),
        grid=grid,
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((1, 1, geo.bq, dv), lambda bi, hi, i, j: (bi, hi, i, 0)),
            pl.BlockSpec((1, 1, geo.bq, 1), lambda bi, hi, i, j: (bi, hi, i, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct((b, h, tp, dv), q.dtype), jax.ShapeDtypeStruct((b, h, tp, 1), F32)],
        scratch_shapes=[
            pltpu.VMEM((geo.bq, LANES), F32),
            pltpu.VMEM((geo.bq, LANES), F32),
            pltpu.VMEM((geo.bq, dv), F32),
        ],
        compiler_params=_compiler_params(interpret),
        interpret=interpret,
        name="ejkernel_flash_attention_fwd",
    )(q, k, v, *extras)


# ---------------------------------------------------------------------------------------- backward


def _probabilities_and_dscores(
    geo: Geometry, q: Any, k: Any, v: Any, do: Any, lse: Any, delta: Any, named: Any, iq: Any, ik: Any
) -> Any:
    """``(p, ds)`` of one tile: ``p = exp(s - lse)`` and the gradient of the loss w.r.t. the raw
    (pre-cap) scores ``ds = p * (dO v^T - delta)`` times the soft cap's derivative."""
    bias, qseg, kseg = _tile_extras(named)
    s, mask, capped = geo.scores(q, k, bias, qseg, kseg, iq, ik)
    lse_safe = jnp.where(lse == -jnp.inf, 0.0, lse)
    p = jnp.where(mask, jnp.exp(s - lse_safe), 0.0)
    dp = lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=F32)
    ds = p * (dp - delta)
    if capped is not None:
        ds = ds * (1.0 - capped * capped)
    return p, ds


def _dkdv_kernel(
    geo: Geometry, q_ref: Any, k_ref: Any, v_ref: Any, do_ref: Any, lse_ref: Any, delta_ref: Any, *refs: Any
) -> None:
    named, (dk_ref, dv_ref, dk_sc, dv_sc) = _split_refs(geo, refs, _n_optional(geo))
    ik, iq = pl.program_id(2), pl.program_id(3)

    @pl.when(iq == 0)
    def _init() -> None:
        dk_sc[...] = jnp.zeros(dk_sc.shape, F32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, F32)

    @pl.when(geo.visible(iq, ik))
    def _step() -> None:
        q, do = q_ref[0, 0], do_ref[0, 0]
        p, ds = _probabilities_and_dscores(
            geo, q, k_ref[0, 0], v_ref[0, 0], do, lse_ref[0, 0], delta_ref[0, 0], named, iq, ik
        )
        t_dims = (((0,), (0,)), ((), ()))  # contract the query axis: P^T dO, dS^T Q
        dv_sc[...] += lax.dot_general(p.astype(do.dtype), do, t_dims, preferred_element_type=F32)
        dk_sc[...] += lax.dot_general(ds.astype(q.dtype), q, t_dims, preferred_element_type=F32)

    @pl.when(iq == pl.num_programs(3) - 1)
    def _finish() -> None:
        dk_ref[0, 0] = (dk_sc[...] * geo.scale).astype(dk_ref.dtype)
        dv_ref[0, 0] = dv_sc[...].astype(dv_ref.dtype)


def _dq_kernel(
    geo: Geometry, q_ref: Any, k_ref: Any, v_ref: Any, do_ref: Any, lse_ref: Any, delta_ref: Any, *refs: Any
) -> None:
    n_out = 2 if geo.has_bias else 1
    named, rest = _split_refs(geo, refs, _n_optional(geo))
    outs, dq_sc = rest[:n_out], rest[n_out]
    dq_ref, dbias_ref = outs[0], (outs[1] if geo.has_bias else None)
    iq, ik = pl.program_id(2), pl.program_id(3)

    @pl.when(ik == 0)
    def _init() -> None:
        dq_sc[...] = jnp.zeros(dq_sc.shape, F32)

    visible = geo.visible(iq, ik)

    @pl.when(visible)
    def _step() -> None:
        k = k_ref[0, 0]
        _, ds = _probabilities_and_dscores(
            geo, q_ref[0, 0], k, v_ref[0, 0], do_ref[0, 0], lse_ref[0, 0], delta_ref[0, 0], named, iq, ik
        )
        dq_sc[...] += lax.dot_general(ds.astype(k.dtype), k, (((1,), (0,)), ((), ())), preferred_element_type=F32)
        if dbias_ref is not None:
            dbias_ref[0, 0] = ds.astype(dbias_ref.dtype)

    if dbias_ref is not None:

        @pl.when(jnp.logical_not(visible))
        def _zero_bias_grad() -> None:
            dbias_ref[0, 0] = jnp.zeros(dbias_ref.shape[2:], dbias_ref.dtype)

    @pl.when(ik == pl.num_programs(3) - 1)
    def _finish() -> None:
        dq_ref[0, 0] = (dq_sc[...] * geo.scale).astype(dq_ref.dtype)


def backward(geo: Geometry, q: Any, k: Any, v: Any, extras: Any, do: Any, lse: Any, delta: Any, interpret: Any) -> Any:
    """``(dq [B, H, Tp, D], dk [B, H, Sp, D], dv [B, H, Sp, Dv], dbias [B, H, Tp, Sp] | None)``;
    ``dk``/``dv`` per query head (the caller sums each group)."""
    b, h, tp, d = q.shape
    sp, dv_dim = k.shape[2], v.shape[3]
    nq, nk = tp // geo.bq, sp // geo.bk

    # dK/dV: grid over key blocks, the query blocks reduced last.
    def q_block(bi: Any, hi: Any, j: Any, i: Any) -> Any:
        return jnp.maximum(i, geo.first_visible_q_block(j)) if geo.causal else i

    def row_spec(width: int) -> Any:
        return pl.BlockSpec((1, 1, geo.bq, width), lambda bi, hi, j, i: (bi, hi, q_block(bi, hi, j, i), 0))

    def kv_spec(width: int) -> Any:
        return pl.BlockSpec((1, 1, geo.bk, width), lambda bi, hi, j, i: (bi, hi // geo.group, j, 0))

    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, geo),
        grid=(b, h, nk, nq),
        in_specs=[
            row_spec(d),
            kv_spec(d),
            kv_spec(dv_dim),
            row_spec(dv_dim),
            row_spec(1),
            row_spec(1),
            *_extra_specs(geo, lambda bi, hi, j, i: q_block(bi, hi, j, i), lambda bi, hi, j, i: j),
        ],
        out_specs=[
            pl.BlockSpec((1, 1, geo.bk, d), lambda bi, hi, j, i: (bi, hi, j, 0)),
            pl.BlockSpec((1, 1, geo.bk, dv_dim), lambda bi, hi, j, i: (bi, hi, j, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct((b, h, sp, d), k.dtype), jax.ShapeDtypeStruct((b, h, sp, dv_dim), v.dtype)],
        scratch_shapes=[pltpu.VMEM((geo.bk, d), F32), pltpu.VMEM((geo.bk, dv_dim), F32)],
        compiler_params=_compiler_params(interpret),
        interpret=interpret,
        name="ejkernel_flash_attention_dkdv",
    )(q, k, v, do, lse, delta, *extras)

    # dQ (and dBias): grid over query blocks, the key blocks reduced last. dBias tiles are all
    # written (zeros where invisible), so its key index is never clamped.
    def kv_block(bi: Any, hi: Any, i: Any, j: Any) -> Any:
        return jnp.minimum(j, geo.last_visible_kv_block(i)) if geo.causal else j

    def q_spec(width: int) -> Any:
        return pl.BlockSpec((1, 1, geo.bq, width), lambda bi, hi, i, j: (bi, hi, i, 0))

    def k_spec(width: int) -> Any:
        return pl.BlockSpec(
            (1, 1, geo.bk, width), lambda bi, hi, i, j: (bi, hi // geo.group, kv_block(bi, hi, i, j), 0)
        )

    out_specs = [q_spec(d)]
    out_shape = [jax.ShapeDtypeStruct((b, h, tp, d), q.dtype)]
    if geo.has_bias:
        out_specs.append(pl.BlockSpec((1, 1, geo.bq, geo.bk), lambda bi, hi, i, j: (bi, hi, i, j)))
        out_shape.append(jax.ShapeDtypeStruct((b, h, tp, sp), F32))
    outs = pl.pallas_call(
        functools.partial(_dq_kernel, geo),
        grid=(b, h, nq, nk),
        in_specs=[
            q_spec(d),
            k_spec(d),
            k_spec(dv_dim),
            q_spec(dv_dim),
            q_spec(1),
            q_spec(1),
            *_extra_specs(geo, lambda bi, hi, i, j: i, kv_block),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((geo.bq, d), F32)],
        compiler_params=_compiler_params(interpret),
        interpret=interpret,
        name="ejkernel_flash_attention_dq",
    )(q, k, v, do, lse, delta, *extras)
    return outs[0], dk, dv, (outs[1] if geo.has_bias else None)
