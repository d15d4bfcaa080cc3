"""The attention-block contract (``ejkernel.modules.operations.flash_attention_block``) on the Triton flash kernels.

The kernels already take which keys each query admits as intervals (``row_lo``/``row_hi`` per query,
``col_lo``/``col_hi`` per key; see ``_kernels``): the block's positions become those intervals
(``key_intervals``/``query_intervals`` of the core, exact because the positions are non-decreasing), so global
offsets, zigzag/striped ring steps and windows need no kernel change. The forward is the flash forward with a
float32 output (the kernels store in the output's dtype, accumulating in float32 either way); the backward
is the flash backward (delta, dK/dV, dQ kernels) from the given, global ``out``/``lse``, with ``delta - dlse``
when the log-sum-exp is differentiated, and float32 gradients. Under ``jax.vmap`` the batch folds into one
launch as the flash attention's does.
"""

from __future__ import annotations

import functools
from typing import Any

import jax.numpy as jnp

from ejkernel.device import fold_vmap
from ejkernel.kernels.signatures._attention import key_intervals, normalize_window, query_intervals
from ejkernel.ops.utils.datacarrier import BwdParams, FwdParams

from ejkernel_triton.flash_attention import interface as _fa

F32 = jnp.float32


def _setup(
    query: Any, key: Any, value: Any, *, q_positions: Any, kv_positions: Any, q_segment_ids: Any,
    kv_segment_ids: Any, softmax_scale: Any, causal: bool, sliding_window: Any, logits_soft_cap: Any,
    fwd_params: Any = None, bwd_params: Any = None,
) -> tuple[Any, dict[str, Any]]:  # fmt: skip
    """The flash attention's launch config and auxiliary arrays, with the intervals of the block's positions."""
    cfg, aux = _fa._prepare(
        query, key, value, None, attention_mask=None, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
        softmax_scale=softmax_scale, causal=False, sliding_window=None, logits_soft_cap=logits_soft_cap,
        dropout_prob=0.0, dropout_seed=None, cu_seqlens_q=None, cu_seqlens_k=None, kv_lengths=None,
        prefix_lengths=None, fwd_params=fwd_params,
        bwd_params=bwd_params,
    )  # fmt: skip
    t, s = query.shape[1], key.shape[1]
    causal, window = bool(causal), normalize_window(sliding_window)
    # One interval table shared by the batch: [1, T] and [1, S].
    rows = key_intervals(q_positions, kv_positions, t, s, causal=causal, window=window)
    cols = query_intervals(q_positions, kv_positions, t, s, causal=causal, window=window)
    aux["row_lo"], aux["row_hi"], aux["col_lo"], aux["col_hi"] = (x[None] for x in (*rows, *cols))
    return cfg, aux


def flash_attention_block(
    query, key, value, *, q_positions=None, kv_positions=None, q_segment_ids=None, kv_segment_ids=None,
    softmax_scale=None, causal=False, sliding_window=None, logits_soft_cap=None, fwd_params=None, bwd_params=None,
):  # fmt: skip
    """``(out, lse)``, both float32: the contract's forward on the Triton forward kernel."""
    cfg, aux = _setup(
        query, key, value, q_positions=q_positions, kv_positions=kv_positions, q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids, softmax_scale=softmax_scale, causal=causal, sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap, fwd_params=fwd_params,
    )  # fmt: skip
    rows, _, aux_axes = _fa._fold_axes(cfg, query.shape[0], None, aux)
    launch = functools.partial(_fa._launch_forward, cfg, out_dtype=F32)
    return fold_vmap(launch, (rows, rows, rows, None, aux_axes), (rows, rows))(query, key, value, None, aux)


def _launch_backward(cfg: Any, res: tuple[Any, ...], do: Any, dlse: Any) -> tuple[Any, Any, Any]:
    q = res[0]
    do = do.astype(q.dtype)
    delta = _fa._bwd_delta(cfg, res[5], do)
    if dlse is not None:
        delta = delta - dlse.astype(F32)
    dk, dv = _fa._bwd_dkdv(cfg, res, do, delta, out_dtype=F32)
    dq = _fa._bwd_dq(cfg, res, do, delta, out_dtype=F32)
    return dq, dk, dv


def flash_attention_block_bwd(
    query, key, value, out, lse, dout, *, dlse=None, q_positions=None, kv_positions=None, q_segment_ids=None,
    kv_segment_ids=None, softmax_scale=None, causal=False, sliding_window=None, logits_soft_cap=None,
    fwd_params=None, bwd_params=None,
):  # fmt: skip
    """``(dq, dk, dv)``, float32: the contract's backward on the Triton backward kernels. ``fwd_params`` (this op's
    one stage): the backward's launch parameters (``BwdParams``, read as the flash backward reads its own)."""
    cfg, aux = _setup(
        query, key, value, q_positions=q_positions, kv_positions=kv_positions, q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids, softmax_scale=softmax_scale, causal=causal, sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap, bwd_params=fwd_params,
    )  # fmt: skip
    res = (query, key, value, None, aux, out, lse.astype(F32))
    rows, _, aux_axes = _fa._fold_axes(cfg, query.shape[0], None, aux)
    res_axes = (rows, rows, rows, None, aux_axes, rows, rows)
    if dlse is None:
        run = fold_vmap(lambda r, d: _launch_backward(cfg, r, d, None), (res_axes, rows), (rows, rows, rows))
        return run(res, dout)
    run = fold_vmap(functools.partial(_launch_backward, cfg), (res_axes, rows, rows), (rows, rows, rows))
    return run(res, dout, dlse)


# ---- what the registry asks -------------------------------------------------------------------------


def supports(invocation: Any) -> str | None:
    """The flash attention's limits (dtypes, head dims, Triton installed)."""
    return _fa.supports(invocation)


def heuristic_cfg(invocation: Any, stage: str = "fwd") -> FwdParams | BwdParams:
    return _fa.heuristic_cfg(invocation, stage)


def candidate_cfgs(invocation: Any, stage: str = "fwd") -> list[FwdParams | BwdParams]:
    return _fa.candidate_cfgs(invocation, stage)


def bwd_heuristic_cfg(invocation: Any, stage: str = "fwd") -> BwdParams | None:
    """The backward op's one stage takes the flash backward's launch parameters (``BwdParams``)."""
    return _fa.heuristic_cfg(invocation, "bwd") if stage == "fwd" else None  # type: ignore[return-value]


def bwd_candidate_cfgs(invocation: Any, stage: str = "fwd") -> list[BwdParams]:
    return _fa.candidate_cfgs(invocation, "bwd") if stage == "fwd" else []  # type: ignore[return-value]


__all__ = [
    "bwd_candidate_cfgs",
    "bwd_heuristic_cfg",
    "candidate_cfgs",
    "flash_attention_block",
    "flash_attention_block_bwd",
    "heuristic_cfg",
    "supports",
]
