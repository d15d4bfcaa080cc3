"""Grouped matmul as a loop over (row tile, group) work items: ``M / tm + G - 1`` matmuls of ``[tm, K] x [K, N]``.

The rows are cut into tiles of ``tm``; a tile that straddles a group boundary is visited once per group
it meets, with the rows of the other groups masked out. Sorting the work items by group (as megablox's
group metadata does) needs at most ``num_tiles + G - 1`` of them, a static bound, so a ``lax.scan``
runs them: the flops are about ``M K N`` (plus one partial tile per group) and the memory ``O(M N)``,
never the ``G x M x K`` masked copy that ``jax.lax.ragged_dot``'s generic lowering builds.

Backward (``jax.custom_vjp``, residuals: the inputs): ``d lhs`` is the same grouped matmul of ``d out``
against the transposed group matrices; ``d rhs[g] = lhs[g rows]^T d out[g rows]`` runs over the same work
items, adding into a float32 ``[G, K, N]`` carry (a group with no rows keeps a zero gradient).
Products accumulate in float32.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ejkernel.device import cdiv, round_up

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Options:
    transpose_rhs: bool
    out_dtype: str
    fwd_tile: int
    bwd_tile: int


def _work_items(group_sizes: jax.Array, m: int, tm: int) -> tuple[jax.Array, ...]:
    """The (tile, group) pairs to visit, sorted by group, padded to the static bound ``num_tiles + G - 1``.

    Returns ``tile [W]``, ``group [W]``, ``valid [W]`` and the row range ``starts [G]``, ``ends [G]`` of
    every group (cut at M, as ``ragged_dot``).
    """
    num_groups = group_sizes.shape[0]
    ends = jnp.clip(jnp.cumsum(group_sizes.astype(jnp.int32)), 0, m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    tiles_per_group = jnp.where(ends > starts, cdiv(ends, tm) - starts // tm, 0)
    num_items = cdiv(m, tm) + num_groups - 1
    first_item = jnp.cumsum(tiles_per_group) - tiles_per_group
    item = jnp.arange(num_items)
    group = jnp.repeat(jnp.arange(num_groups), tiles_per_group, total_repeat_length=num_items)
    tile = starts[group] // tm + item - first_item[group]
    valid = item < jnp.sum(tiles_per_group)
    return jnp.where(valid, tile, 0), group, valid, starts, ends


def _rows(
    x: jax.Array, tile: jax.Array, group: jax.Array, valid: jax.Array, starts: jax.Array, ends: jax.Array, tm: int
) -> jax.Array:
    """The ``tm`` rows of tile ``tile`` of ``x [M_pad, *]``, zero where they are not in ``group``."""
    rows = tile * tm + jnp.arange(tm)
    keep = valid & (rows >= starts[group]) & (rows < ends[group])
    block = lax.dynamic_slice_in_dim(x, tile * tm, tm, axis=0)
    return jnp.where(keep[:, None], block, jnp.zeros((), x.dtype))


def gmm(
    lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, tm: int, transpose_rhs: bool, out_dtype: Any
) -> jax.Array:
    """``out[i] = lhs[i] @ rhs[g(i)]`` (``rhs[g(i)].T`` with ``transpose_rhs``), tile by tile; ``[M, N]``."""
    m = lhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    tm = max(1, min(tm, m))
    m_pad = round_up(m, tm)
    lhs = jnp.pad(lhs, [(0, m_pad - m), (0, 0)])
    tile, group, valid, starts, ends = _work_items(group_sizes, m, tm)
    contract = ((1,), (1,)) if transpose_rhs else ((1,), (0,))
    dtype = jnp.promote_types(lhs.dtype, rhs.dtype)  # the backward multiplies d out (maybe float32) by rhs

    def step(out: jax.Array, item: Any) -> tuple[jax.Array, None]:
        b_tile, b_group, b_valid = item
        b_lhs = _rows(lhs, b_tile, b_group, b_valid, starts, ends, tm).astype(dtype)  # [tm, K]
        b_rhs = lax.dynamic_index_in_dim(rhs, b_group, axis=0, keepdims=False).astype(dtype)
        b_out = lax.dot_general(b_lhs, b_rhs, (contract, ((), ())), preferred_element_type=F32)
        acc = lax.dynamic_slice_in_dim(out, b_tile * tm, tm, axis=0)
        return lax.dynamic_update_slice_in_dim(out, acc + b_out, b_tile * tm, axis=0), None

    out, _ = lax.scan(step, jnp.zeros((m_pad, n), F32), (tile, group, valid))
    return out[:m].astype(out_dtype)


def tgmm(lhs: jax.Array, dout: jax.Array, group_sizes: jax.Array, tm: int) -> jax.Array:
    """``d rhs[g] = lhs[rows of g]^T @ dout[rows of g]``, tile by tile; ``[G, K, N]`` in float32."""
    m, k = lhs.shape
    n = dout.shape[1]
    if m == 0:
        return jnp.zeros((group_sizes.shape[0], k, n), F32)
    tm = max(1, min(tm, m))
    m_pad = round_up(m, tm)
    lhs = jnp.pad(lhs, [(0, m_pad - m), (0, 0)])
    dout = jnp.pad(dout, [(0, m_pad - m), (0, 0)])
    tile, group, valid, starts, ends = _work_items(group_sizes, m, tm)
    dtype = jnp.promote_types(lhs.dtype, dout.dtype)

    def step(drhs: jax.Array, item: Any) -> tuple[jax.Array, None]:
        b_tile, b_group, b_valid = item
        b_lhs = _rows(lhs, b_tile, b_group, b_valid, starts, ends, tm).astype(dtype)  # [tm, K], other groups 0
        b_dout = lax.dynamic_slice_in_dim(dout, b_tile * tm, tm, axis=0).astype(dtype)  # [tm, N]
        b_d = lax.dot_general(b_lhs, b_dout, (((0,), (0,)), ((), ())), preferred_element_type=F32)
        acc = lax.dynamic_index_in_dim(drhs, b_group, axis=0, keepdims=False)
        return lax.dynamic_update_index_in_dim(drhs, acc + b_d, b_group, axis=0), None

    drhs, _ = lax.scan(step, jnp.zeros((group_sizes.shape[0], k, n), F32), (tile, group, valid))
    return drhs


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def grouped_matmul(opts: Options, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    return gmm(lhs, rhs, group_sizes, opts.fwd_tile, opts.transpose_rhs, opts.out_dtype)


def _fwd(opts: Options, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> Any:
    return grouped_matmul(opts, lhs, rhs, group_sizes), (lhs, rhs, group_sizes)


def _bwd(opts: Options, res: Any, dout: jax.Array) -> Any:
    lhs, rhs, group_sizes = res
    # d lhs[i] = d out[i] @ rhs[g(i)]^T: the same grouped matmul with the other orientation of rhs
    dlhs = gmm(dout, rhs, group_sizes, opts.bwd_tile, not opts.transpose_rhs, lhs.dtype)
    drhs = tgmm(lhs, dout, group_sizes, opts.bwd_tile)  # [G, K, N]
    if opts.transpose_rhs:
        drhs = jnp.swapaxes(drhs, 1, 2)
    zeros = jnp.zeros(group_sizes.shape, jax.dtypes.float0)
    return dlhs, drhs.astype(rhs.dtype), zeros


grouped_matmul.defvjp(_fwd, _bwd)
