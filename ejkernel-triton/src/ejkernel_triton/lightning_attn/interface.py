"""Triton ``lightning_attn`` for decoding: the fused recurrent kernel of ``gla`` with the state of head ``h``
decaying by ``exp(-slope[h])`` per token (one log decay per token and head, ``[B, T, H]``).

Launch parameters, the declined calls and the gradients (the VJP of the core's reference recurrence) are those of
the Triton ``gla`` (``ejkernel_triton.gla.interface``). Importing this module does not import Triton.
"""

from __future__ import annotations

from typing import Any

import jax

from ejkernel_triton._gates import call_gla, slope_scalar_decay
from ejkernel_triton._recurrent import NoBwdParams, RecurrentParams, supports_recurrent
from ejkernel_triton.gla.interface import candidate_cfgs, gla, heuristic_cfg

__all__ = ["candidate_cfgs", "heuristic_cfg", "lightning_attn", "supports"]


def supports(inv: Any) -> str | None:
    return supports_recurrent("lightning_attn", inv, ("slope",))


def lightning_attn(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slope: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    cu_seqlens: jax.Array | None = None,
    fwd_params: RecurrentParams | None = None,
    bwd_params: NoBwdParams | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Linear attention decaying by ``exp(-slope[h])`` per token (contract: ``ejkernel.modules.operations.lightning_attn``).

    Shapes: ``q``, ``k``, ``v [B, T, H, K|V]``, ``slope [H]``, ``initial_state [B or N, H, K, V]``, ``cu_seqlens
    [N + 1]``; returns ``(o [B, T, H, V] in q's dtype, final state float32 or None)``."""
    return call_gla(
        gla,
        q,
        k,
        v,
        slope_scalar_decay(q, slope),
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        fwd_params=fwd_params,
        bwd_params=bwd_params,
    )
