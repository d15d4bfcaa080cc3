"""Triton ``recurrent`` with a value gate ``g_v`` and no key gate, for training shapes: the value-side chunked
kernels (``ejkernel_triton._value_chunk``) with ``g + g_v`` as one log decay per value channel ``[B, T, H, V]``
(``g`` zeros when absent), ``reverse`` as the flipped sequence (``ejkernel_triton._gates``).

Registered apart from ``triton_chunk`` (as ``triton_value_chunk``), above XLA on GPUs: on an H200 (2026-12-04,
``benchmarks/gpucheck/value_chunk.py``, B4 T4096 H16 K=V=128 bf16, outputs and gradients checked first) its forward
took 1.38 ms against XLA's 2.73, forward + backward 6.90 against 8.43 (the backward builds each chunk's pair matrices
once, ``value_pairs``; before that it took 11.17 against 8.24).

Declined (``supports``): calls without a value gate (``triton_chunk``'s), a key gate with it (also
``triton_chunk``'s: ``recurrent.chunk`` runs these kernels with the key side's decays added), what the chunked
``gla`` declines, and decode steps on a GPU (``decode_reason``). Launch
parameters: :class:`~ejkernel_triton.gla.chunk.ChunkFwdParams`, :class:`~ejkernel_triton.gla.chunk.ChunkBwdParams`
(``simple_gla``'s heuristic and candidates). Importing this module does not import Triton.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ejkernel_triton._gates import call_gla, scalar_decay
from ejkernel_triton._recurrent import arguments, decode_reason
from ejkernel_triton._value_chunk import candidate_cfgs, heuristic_cfg, value_gla
from ejkernel_triton.gla import chunk
from ejkernel_triton.gla.chunk import ChunkBwdParams, ChunkFwdParams

__all__ = ["candidate_cfgs", "heuristic_cfg", "recurrent", "supports"]

_BOTH_GATES = (
    "ejkernel-triton recurrent (value-gate chunks): a key gate g_k together with a value gate g_v is triton_chunk's "
    "(recurrent.chunk runs these kernels with the key side's decays too)"
)


def supports(inv: Any) -> str | None:
    args = arguments(inv)
    if args.get("g_v") is None:
        return "ejkernel-triton recurrent (value-gate chunks): no value gate g_v (triton_chunk's job)"
    if args.get("g_k") is not None:
        return _BOTH_GATES
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
    """The gated linear recurrence (contract: ``ejkernel.modules.operations.recurrent``) with a value gate and no
    key gate.

    Shapes: ``q``, ``k``, ``v [B, T, H, K|V]``, ``g [B, T, H]``, ``g_v [B, T, H, V]``, ``initial_state [B or N,
    H, K, V]``, ``cu_seqlens [N + 1]``; returns ``(o [B, T, H, V] in q's dtype, final state float32 or None)``."""
    if g_v is None or g_k is not None:  # what supports() declines, when called directly
        raise ValueError(
            _BOTH_GATES if g_v is not None else "ejkernel-triton recurrent (value-gate chunks): g_v is required"
        )
    log_decay = scalar_decay(q, g)[..., None] + jnp.asarray(g_v).astype(jnp.float32)  # [B, T, H, V]
    return call_gla(
        value_gla,
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
