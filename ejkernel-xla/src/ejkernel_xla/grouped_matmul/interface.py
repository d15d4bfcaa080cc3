"""Plain XLA grouped matmul: a scan over (row tile, group) work items (see ``_tiled``); every backend.

On TPU ``ragged`` (``jax.lax.ragged_dot``, lowered natively) is registered above it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.device import next_power_of_2
from ejkernel.modules.operations.grouped_matmul import canonical_dtype

from ejkernel_xla.grouped_matmul import _tiled
from ejkernel_xla.params import TiledGmmParams, coerce

# Rows per tile, measured on CPU (M=4096, K=N=512, forward+backward): with G=8 experts 64 and 128 were
# fastest (42, 37 ms; 32: 68, 256: 76), with G=64 64 was (173 ms; 32: 263, 128: 325). ragged_dot's
# generic lowering took 1767 ms (G=16). Hence a tile near the mean group, at most 128 (default_tile).
DEFAULT_TILE = 128
CANDIDATE_TILES = (32, 64, 128, 256, 512)
# Compiled as one program also when called eagerly (op-by-op dispatch of the scans is slow to start).
_run = jax.jit(_tiled.grouped_matmul, static_argnums=(0,))


def default_tile(m: int, g: int) -> int:
    """Row tile: the power of two at most ``M / G`` (the mean group), clipped to [8, 128].

    A tile that straddles a group boundary is multiplied once per group it meets, so the work is about
    ``M K N + (G - 1) tm K N``: a tile near the mean group size keeps that overhead near ``M K N``.
    """
    mean_group = max(1, m // max(1, g))
    return max(8, min(DEFAULT_TILE, 1 << (mean_group.bit_length() - 1)))


def _dims(inv: Any) -> tuple[int, int]:
    return int(inv.arguments["lhs"].shape[0]), int(inv.arguments["rhs"].shape[0])


def heuristic_cfg(inv: Any, stage: str) -> TiledGmmParams:
    return TiledGmmParams(block_m=default_tile(*_dims(inv)))


def candidate_cfgs(inv: Any, stage: str) -> list[TiledGmmParams]:
    m, g = _dims(inv)
    tiles = [default_tile(m, g)] + [t for t in CANDIDATE_TILES if t <= max(8, next_power_of_2(m))]
    return [TiledGmmParams(block_m=t) for t in dict.fromkeys(tiles)]


def _tile(params: Any, fallback: int) -> int:
    """The row tile of ``params`` (a ``TiledGmmParams``, checked when made; or generic, mapped), else ``fallback``."""
    p = coerce(TiledGmmParams, params)
    return fallback if p is None or p.block_m is None else p.block_m


def grouped_matmul(
    lhs, rhs, group_sizes, *, transpose_rhs=False, preferred_element_type=None, fwd_params=None, bwd_params=None
):  # fmt: skip
    """Tiled grouped matmul (contract: ``ejkernel.modules.operations.grouped_matmul``).

    ``fwd_params``/``bwd_params``: ``TiledGmmParams`` (``ejkernel_xla.params``), ``block_m`` the row tile of
    the forward and of the backward (None: ``default_tile``, the backward: the forward's).
    """
    fwd_tile = _tile(fwd_params, default_tile(lhs.shape[0], rhs.shape[0]))
    opts = _tiled.Options(
        transpose_rhs=bool(transpose_rhs),
        out_dtype=canonical_dtype(preferred_element_type) or jnp.dtype(lhs.dtype).name,
        fwd_tile=fwd_tile,
        bwd_tile=_tile(bwd_params, fwd_tile),
    )
    return _run(opts, lhs, rhs, group_sizes)


__all__ = ["candidate_cfgs", "default_tile", "grouped_matmul", "heuristic_cfg"]
