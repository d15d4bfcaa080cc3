"""XLA ``native_sparse_attention``: the selected branch gathers each token's blocks (``_selected``); the
compressed and sliding branches run on ``block_sparse_attention``'s blockwise core (over mean-pooled
keys; with a window), which skips the key tiles their causal/window structure rules out."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.ops.utils.datacarrier import BwdParams, FwdParams

from ejkernel_xla.block_sparse_attention import _core
from ejkernel_xla.native_sparse_attention._selected import Options, clean_indices, default_tiles, selected_attention

F32 = jnp.float32

# Around the heuristic (query tokens, slots per step): these factors, clipped, duplicates dropped.
_CANDIDATE_FACTORS = ((1, 1), (2, 1), (2, 0.5), (0.5, 2))


def _dims(inv: Any) -> tuple[int, int, int, int, int, int]:
    a = inv.arguments
    b, t, _, d = a["query"].shape
    kh, n = a["block_indices"].shape[2:]
    return int(b), int(t), int(kh), int(n), int(a["block_size"]), int(d)


def heuristic_cfg(inv: Any, stage: str) -> FwdParams | BwdParams:
    tq, keys = default_tiles(*_dims(inv))
    cls = FwdParams if stage == "fwd" else BwdParams
    return cls(q_blocksize=tq, kv_blocksize=keys)


def candidate_cfgs(inv: Any, stage: str) -> list[FwdParams | BwdParams]:
    b, t, kh, n, bs, d = _dims(inv)
    tq, keys = default_tiles(b, t, kh, n, bs, d)
    ns = keys // bs
    cls = FwdParams if stage == "fwd" else BwdParams
    out: list[FwdParams | BwdParams] = []
    for fq, fs in _CANDIDATE_FACTORS:
        cfg = cls(q_blocksize=max(1, min(t, int(tq * fq))), kv_blocksize=max(1, min(n, int(ns * fs))) * bs)
        if cfg not in out:
            out.append(cfg)
    return out


def mean_pool(x: jax.Array, block_size: int) -> jax.Array:
    """``[B, S, K, E]`` -> ``[B, NB, K, E]`` float32: the mean of every block (the last one of the keys it has)."""
    b, s, kh, e = x.shape
    nb = -(-s // block_size)
    sizes = jnp.minimum(block_size, s - jnp.arange(nb) * block_size).astype(F32)
    x = jnp.pad(x.astype(F32), ((0, 0), (0, nb * block_size - s), (0, 0), (0, 0)))
    return x.reshape(b, nb, block_size, kh, e).sum(axis=2) / sizes[None, :, None, None]


def _tiles(params: Any) -> tuple[int | None, int | None]:
    return (None, None) if params is None else (params.q_blocksize, params.kv_blocksize)


def native_sparse_attention(
    query, key, value, block_indices, *, block_counts=None, g_slc=None, g_cmp=None, g_swa=None, block_size=64,
    window_size=0, softmax_scale=None, causal=True, fwd_params=None, bwd_params=None,
):  # fmt: skip
    """NSA (contract: ``ejkernel.modules.operations.native_sparse_attention``).

    ``fwd_params``/``bwd_params``: ``q_blocksize`` query tokens per step and ``kv_blocksize`` keys per
    step in every branch (selected: rounded down to whole blocks, that many slots at once; compressed:
    compressed keys). The heuristic is tuned for the selected branch, the dominant cost.
    """
    t, s = query.shape[1], key.shape[1]
    scale = float(query.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale)
    n_blocks = -(-s // block_size)
    idx = clean_indices(jnp.asarray(block_indices), block_counts, n_blocks)
    sel = Options(scale=scale, block_size=int(block_size), causal=bool(causal), fwd_tiles=_tiles(fwd_params),
                  bwd_tiles=_tiles(bwd_params), out_f32=True)  # fmt: skip
    out = selected_attention(sel, query, key, value, idx)
    if g_slc is not None:
        out = out * g_slc.astype(F32)[..., None]
    if g_cmp is not None:
        cmp = _core.Options(scale=scale, causal=bool(causal), offset=s - t, key_stride=int(block_size), out_f32=True,
                            fwd_tiles=_tiles(fwd_params), bwd_tiles=_tiles(bwd_params))  # fmt: skip
        k_cmp, v_cmp = (mean_pool(x, block_size).astype(query.dtype) for x in (key, value))
        o_cmp = _core.attention(cmp, query, k_cmp, v_cmp, None, None, None)
        out = out + o_cmp * g_cmp.astype(F32)[..., None]
    if window_size > 0:
        if g_swa is None:
            raise ValueError(f"native_sparse_attention: window_size={window_size} needs its gate g_swa")
        left = window_size - 1
        window = (left, 0) if causal else (left, left)
        swa = _core.Options(scale=scale, causal=bool(causal), offset=s - t, window=window, out_f32=True,
                            fwd_tiles=_tiles(fwd_params), bwd_tiles=_tiles(bwd_params))  # fmt: skip
        o_swa = _core.attention(swa, query, key, value, None, None, None)
        out = out + o_swa * g_swa.astype(F32)[..., None]
    return out.astype(query.dtype)


__all__ = ["candidate_cfgs", "heuristic_cfg", "mean_pool", "native_sparse_attention"]
