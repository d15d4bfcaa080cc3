"""Triton ``recurrent`` for decoding: the fused recurrent kernel of ``gla``, the scalar gate ``g [B, T, H]`` and the
key gate ``g_k [B, T, H, K]`` added into one key-side log decay (without ``g_k``: ``g`` alone, one log decay per
token and head), the value gate ``g_v [B, T, H, V]`` applied to the state's columns (``S_t = diag(exp(g_t +
g_k,t)) S_{t-1} diag(exp(g_v,t)) + k_t^T v_t``).

``reverse`` runs the flipped sequence (``ejkernel_triton._gates``). Declined (``supports``): what the Triton
``gla`` declines. Launch parameters and gradients (the VJP of the core's reference recurrence) are the Triton
``gla``'s (``ejkernel_triton.gla.interface``). Importing this module does not import Triton.
"""

from __future__ import annotations

from typing import Any

import jax

from ejkernel_triton._gates import call_gla, recurrent_log_decay, scalar_decay
from ejkernel_triton._recurrent import NoBwdParams, RecurrentParams, supports_recurrent
from ejkernel_triton.gla.interface import candidate_cfgs, gated_recurrence, heuristic_cfg

__all__ = ["candidate_cfgs", "heuristic_cfg", "recurrent", "supports"]


def supports(inv: Any) -> str | None:
    return supports_recurrent("recurrent", inv, ("g", "g_k", "g_v"))


def recurrent(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array | None = None,
    g_k: jax.Array | None = None,
    g_v: jax.Array | None = None,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    cu_seqlens: jax.Array | None = None,
    fwd_params: RecurrentParams | None = None,
    bwd_params: NoBwdParams | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """The gated linear recurrence (contract: ``ejkernel.modules.operations.recurrent``).

    Shapes: ``q``, ``k``, ``v [B, T, H, K|V]``, ``g [B, T, H]``, ``g_k [B, T, H, K]``, ``g_v [B, T, H, V]``, ``initial_state
    [B or N, H, K, V]``, ``cu_seqlens [N + 1]``; returns ``(o [B, T, H, V] in q's dtype, final state float32 or
    None)``."""
    return call_gla(
        gated_recurrence,
        q,
        k,
        v,
        scalar_decay(q, g) if g_k is None else recurrent_log_decay(q, g, g_k),
        log_decay_v=g_v,
        reverse=reverse,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        fwd_params=fwd_params,
        bwd_params=bwd_params,
    )
