"""Triton ``recurrent`` for training shapes, ``reverse`` as the flipped sequence (``ejkernel_triton._gates``):
without a key gate ``g_k``, ``simple_gla``'s chunked kernels (``ejkernel_triton._simple_chunk``) with the scalar gate
``g [B, T, H]`` (zeros when absent) as the per-token log decay; with one, the chunked ``gla`` kernels
(``ejkernel_triton.gla.chunk``) with ``g`` and ``g_k`` added into one key-side log decay ``[B, T, H, K]``.

Declined (``supports``): a value gate ``g_v`` (the kernels decay the key side; ``recurrent.value_chunk`` takes it
without a key gate), besides what the chunked ``gla``
declines, and decode steps on a GPU (``decode_reason``). Launch parameters
(:class:`~ejkernel_triton.gla.chunk.ChunkFwdParams`, :class:`~ejkernel_triton.gla.chunk.ChunkBwdParams`) go to
whichever kernels run (the heuristic and the candidates are theirs). Importing this module does not import Triton.
"""

from __future__ import annotations

from typing import Any

import jax

from ejkernel_triton import _simple_chunk as simple
from ejkernel_triton._gates import call_gla, recurrent_log_decay, scalar_decay
from ejkernel_triton._recurrent import arguments, decode_reason
from ejkernel_triton.gla import chunk
from ejkernel_triton.gla.chunk import ChunkBwdParams, ChunkFwdParams

__all__ = ["candidate_cfgs", "heuristic_cfg", "recurrent", "supports"]


def _keyed(inv: Any) -> bool:
    """Whether the call has a key gate (then the chunked ``gla`` kernels run it)."""
    return arguments(inv).get("g_k") is not None


def heuristic_cfg(inv: Any, stage: str = "fwd") -> ChunkFwdParams | ChunkBwdParams:
    return chunk.heuristic_cfg(inv, stage) if _keyed(inv) else simple.heuristic_cfg(inv, stage)


def candidate_cfgs(inv: Any, stage: str = "fwd") -> list[ChunkFwdParams] | list[ChunkBwdParams]:
    return chunk.candidate_cfgs(inv, stage) if _keyed(inv) else simple.candidate_cfgs(inv, stage)


def supports(inv: Any) -> str | None:
    if arguments(inv).get("g_v") is not None:
        return (
            "ejkernel-triton recurrent (chunked): a value gate g_v is not supported (the kernels decay the key side; "
            "triton_value_chunk takes it without a key gate)"
        )
    return chunk.supports(inv) or decode_reason("recurrent", inv)


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
    fwd_params: ChunkFwdParams | None = None,
    bwd_params: ChunkBwdParams | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """The gated linear recurrence (contract: ``ejkernel.modules.operations.recurrent``) without a value gate.

    Shapes: ``q``, ``k``, ``v [B, T, H, K|V]``, ``g [B, T, H]``, ``g_k [B, T, H, K]``, ``initial_state
    [B or N, H, K, V]``, ``cu_seqlens [N + 1]``; returns ``(o [B, T, H, V] in q's dtype, final state float32 or
    None)``."""
    if g_v is not None:  # what supports() declines, when called directly
        raise ValueError("ejkernel-triton recurrent (chunked): a value gate g_v is not supported")
    if g_k is None:
        kernels, log_decay = simple.simple_gla, scalar_decay(q, g)
    else:
        kernels, log_decay = chunk.gla, recurrent_log_decay(q, g, g_k)
    return call_gla(
        kernels,
        q,
        k,
        v,
        log_decay,
        reverse=reverse,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        fwd_params=fwd_params,
        bwd_params=bwd_params,
    )
