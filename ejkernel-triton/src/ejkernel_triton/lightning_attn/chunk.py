"""Triton ``lightning_attn`` for training shapes: ``simple_gla``'s chunked kernels (``ejkernel_triton._simple_chunk``)
with the log decay ``-slope[h]`` on every token of head ``h`` (``ejkernel_triton._gates``); ``slope``'s gradient is
the sum of the per-token decays' (through the broadcast).

Launch parameters (:class:`~ejkernel_triton.gla.chunk.ChunkFwdParams`,
:class:`~ejkernel_triton.gla.chunk.ChunkBwdParams`) and the backward are ``simple_gla``'s; the declined calls the
chunked ``gla``'s, and decode steps on a GPU. Importing this module does not import Triton.
"""

from __future__ import annotations

from typing import Any

import jax

from ejkernel_triton._gates import call_gla, slope_scalar_decay
from ejkernel_triton._recurrent import decode_reason
from ejkernel_triton._simple_chunk import candidate_cfgs, heuristic_cfg, simple_gla
from ejkernel_triton.gla import chunk
from ejkernel_triton.gla.chunk import ChunkBwdParams, ChunkFwdParams

__all__ = ["candidate_cfgs", "heuristic_cfg", "lightning_attn", "supports"]


def supports(inv: Any) -> str | None:
    """The chunked ``gla``'s (dtypes other than float32, bfloat16 and float16, or head dims above 256), and on a GPU
    decode steps (``decode_reason``)."""
    return chunk.supports(inv) or decode_reason("lightning_attn", inv)


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
    fwd_params: ChunkFwdParams | None = None,
    bwd_params: ChunkBwdParams | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Linear attention decaying by ``exp(-slope[h])`` per token (contract: ``ejkernel.modules.operations.lightning_attn``).

    Shapes: ``q``, ``k``, ``v [B, T, H, K|V]``, ``slope [H]``, ``initial_state [B or N, H, K, V]``, ``cu_seqlens
    [N + 1]``; returns ``(o [B, T, H, V] in q's dtype, final state float32 or None)``."""
    return call_gla(
        simple_gla,
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
