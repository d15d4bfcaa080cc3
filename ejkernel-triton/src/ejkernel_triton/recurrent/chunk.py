"""Triton ``recurrent`` for training shapes, ``reverse`` as the flipped sequence (``ejkernel_triton._gates``):
without a key gate ``g_k``, ``simple_gla``'s chunked kernels (``ejkernel_triton._simple_chunk``) with the scalar gate
``g [B, T, H]`` (zeros when absent) as the per-token log decay; with one, the chunked ``gla`` kernels
(``ejkernel_triton.gla.chunk``) with ``g`` and ``g_k`` added into one key-side log decay ``[B, T, H, K]``; with a
value gate ``g_v`` too, the value-side chunked kernels with that key side added (``keyed_value_gla`` of
``ejkernel_triton._value_chunk``: ``S_t = diag(exp(g_t + g_k,t)) S_{t-1} diag(exp(g_v,t)) + k_t^T v_t``).

Declined (``supports``): a value gate ``g_v`` without a key gate (``recurrent.value_chunk``'s, registered as
``triton_value_chunk``), besides what the chunked ``gla`` declines, and decode steps on a GPU (``decode_reason``).
Launch parameters (:class:`~ejkernel_triton.gla.chunk.ChunkFwdParams`,
:class:`~ejkernel_triton.gla.chunk.ChunkBwdParams`) go to whichever kernels run (the heuristic and the candidates
are theirs). Importing this module does not import Triton.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ejkernel_triton import _simple_chunk as simple
from ejkernel_triton import _value_chunk as value
from ejkernel_triton._gates import call_gla, recurrent_log_decay, scalar_decay
from ejkernel_triton._recurrent import arguments, decode_reason
from ejkernel_triton.gla import chunk
from ejkernel_triton.gla.chunk import ChunkBwdParams, ChunkFwdParams

__all__ = ["candidate_cfgs", "heuristic_cfg", "recurrent", "supports"]


def _family(inv: Any) -> Any:
    """The module whose plans the call's kernels take: ``gla``'s with a key gate alone, the value-side kernels'
    with both gates, ``simple_gla``'s without a key gate."""
    args = arguments(inv)
    if args.get("g_k") is None:
        return simple
    return chunk if args.get("g_v") is None else value


def heuristic_cfg(inv: Any, stage: str = "fwd") -> ChunkFwdParams | ChunkBwdParams:
    return _family(inv).heuristic_cfg(inv, stage)


def candidate_cfgs(inv: Any, stage: str = "fwd") -> list[ChunkFwdParams] | list[ChunkBwdParams]:
    return _family(inv).candidate_cfgs(inv, stage)


def supports(inv: Any) -> str | None:
    args = arguments(inv)
    if args.get("g_v") is not None and args.get("g_k") is None:
        return (
            "ejkernel-triton recurrent (chunked): a value gate g_v without a key gate g_k is triton_value_chunk's "
            "(recurrent.value_chunk)"
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
    """The gated linear recurrence (contract: ``ejkernel.modules.operations.recurrent``), a value gate only with a
    key gate.

    Shapes: ``q``, ``k``, ``v [B, T, H, K|V]``, ``g [B, T, H]``, ``g_k [B, T, H, K]``, ``g_v [B, T, H, V]``,
    ``initial_state [B or N, H, K, V]``, ``cu_seqlens [N + 1]``; returns ``(o [B, T, H, V] in q's dtype, final
    state float32 or None)``."""
    if g_v is not None and g_k is None:  # what supports() declines, when called directly
        raise ValueError("ejkernel-triton recurrent (chunked): a value gate g_v needs a key gate g_k here")
    kernels: Callable[..., tuple[jax.Array, jax.Array | None]]
    if g_k is None:
        kernels, log_decay = simple.simple_gla, scalar_decay(q, g)
    elif g_v is None:
        kernels, log_decay = chunk.gla, recurrent_log_decay(q, g, g_k)
    else:  # both sides' log decays side by side, [B, T, H, K + V]
        log_decay = jnp.concatenate([recurrent_log_decay(q, g, g_k), jnp.asarray(g_v).astype(jnp.float32)], -1)
        kernels = value.keyed_value_gla
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
