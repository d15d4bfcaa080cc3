"""Mosaic TPU ``gla`` (contract: ``ejkernel.modules.operations.gla``).

Serves every option of the contract: ``scale``, ``initial_state`` (differentiable), ``output_final_state``
and packed sequences (``cu_seqlens``), in float32 and bfloat16; gates and the initial state in any float
dtype. It declines float16 ``q``/``k``/``v`` (``supports``). The chunk length is the launch parameters'
``GlaChunkParams.chunk_size`` (forward and backward each: a power of two from 16 to 128; ``T`` is padded
to it).

The forward saves the state entering each chunk (``[B, H, T / C, K, V]`` float32, as the XLA version's
chunked form does); with another chunk length for the backward, the backward recomputes them with its own.
Packed sequences are gathered into a chunk-aligned layout in which every sequence starts a new chunk.
Grouped value heads (``v`` ``[B, T, HV, V]``, ``HV`` a multiple of ``H``): ``q`` and ``k`` are repeated to the
value heads before the kernels (``repeat_query_key_heads``), which see one head count; their gradients sum
over each group.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from ejkernel.device import cdiv
from ejkernel.kernels.signatures._linear_attention import repeat_query_key_heads

from ejkernel_pallas.tpu.gla._kernels import LAST, RESET, SUB, Geometry, backward, forward
from ejkernel_pallas.tpu.params import GlaChunkParams, coerce

F32 = jnp.float32
SUPPORTED_DTYPES = ("float32", "bfloat16")
MIN_CHUNK, MAX_CHUNK = SUB, 128
# The default chunk: the XLA version's (64 on CPU). On a TPU the in-chunk element-wise work grows with
# the chunk while the state's matmuls fill the MXU better; 64 is the middle of the candidates.
DEFAULT_CHUNK = 64
CANDIDATE_CHUNKS = (16, 32, 64, 128)


def chunk_size(requested: int | None, t: int) -> int:
    """The chunk for length ``t``: ``requested`` (default ``DEFAULT_CHUNK``) rounded down to a power of two,
    within ``[16, 128]`` and at most ``t`` rounded up to a power of two."""
    c = DEFAULT_CHUNK if requested is None else max(int(requested), 1)
    c = min(max(1 << (c.bit_length() - 1), MIN_CHUNK), MAX_CHUNK)
    return max(MIN_CHUNK, min(c, 1 << max(0, (t - 1).bit_length())))


def supports(inv: Any) -> str | None:
    """``None`` when this kernel serves ``inv``, else the reason it does not."""
    dtype = str(np.dtype(inv.arguments["q"].dtype))
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} (Mosaic TPU kernels take float32 or bfloat16)"
    return None


def heuristic_cfg(inv: Any, stage: str) -> GlaChunkParams:
    """The chunk length for the call's length (both passes)."""
    t = int(inv.arguments["q"].shape[1])
    return GlaChunkParams(chunk_size=chunk_size(None, t))


def candidate_cfgs(inv: Any, stage: str) -> list[GlaChunkParams]:
    """The chunk lengths the autotuner times: ``CANDIDATE_CHUNKS`` that fit the call's length."""
    t = int(inv.arguments["q"].shape[1])
    return [GlaChunkParams(chunk_size=c) for c in dict.fromkeys(chunk_size(c, t) for c in CANDIDATE_CHUNKS)]


def _interpret_params() -> Any:
    """TPU interpret mode (on CPU, for tests); races are looked for when ``EJKERNEL_PALLAS_DETECT_RACES=1``."""
    return pltpu.InterpretParams(detect_races=os.environ.get("EJKERNEL_PALLAS_DETECT_RACES") == "1")


# ---- layout ---------------------------------------------------------------------------------------


class Plan(NamedTuple):
    """Where tokens go in the kernels' chunk-aligned layout of ``length`` positions.

    ``flags``/``seq`` ``[NC]`` int32: per chunk, ``RESET``/``LAST`` bits and its sequence. With packed
    sequences, ``src [length]`` (the token at each position, T for padding), ``dst [T]`` (the position of
    each token, ``length`` outside every sequence) and ``nonempty [N]``; else those are ``None``.
    """

    length: int
    flags: jax.Array
    seq: jax.Array
    src: jax.Array | None
    dst: jax.Array | None
    nonempty: jax.Array | None


def _plan(t: int, chunk: int, cu_seqlens: jax.Array | None) -> Plan:
    if cu_seqlens is None:
        n_chunks = -(-t // chunk)
        dense = np.zeros(n_chunks, np.int32)
        dense[0] |= RESET
        dense[-1] |= LAST
        return Plan(n_chunks * chunk, jnp.asarray(dense), jnp.zeros(n_chunks, jnp.int32), None, None, None)
    n = cu_seqlens.shape[0] - 1
    n_chunks = t // chunk + n  # the sum of ceil(length / C) over the sequences is at most this
    cu = jnp.clip(cu_seqlens.astype(jnp.int32), 0, t)
    start, end = cu[:-1], cu[1:]
    lengths = jnp.maximum(end - start, 0)
    chunks = cdiv(lengths, chunk)
    first = jnp.cumsum(chunks) - chunks  # first chunk of each sequence
    used = jnp.sum(chunks)
    c = jnp.arange(n_chunks)
    seq = jnp.clip(jnp.searchsorted(first, c, side="right") - 1, 0, n - 1)  # empty sequences own no chunk
    inside = c < used
    flags = jnp.where(inside & (c == first[seq]), RESET, 0)
    flags |= jnp.where(inside & (c == first[seq] + chunks[seq] - 1), LAST, 0)
    p = jnp.arange(n_chunks * chunk)
    p_seq = seq[p // chunk]
    j = p - first[p_seq] * chunk  # offset inside the sequence
    src = jnp.where((p // chunk < used) & (j < lengths[p_seq]), start[p_seq] + j, t)
    tok = jnp.arange(t)
    t_seq = jnp.clip(jnp.searchsorted(cu, tok, side="right") - 1, 0, n - 1)
    in_seq = (tok >= cu[0]) & (tok < cu[n])
    dst = jnp.where(in_seq, first[t_seq] * chunk + tok - start[t_seq], n_chunks * chunk)
    return Plan(n_chunks * chunk, flags.astype(jnp.int32), seq.astype(jnp.int32), src, dst, chunks > 0)


def _to_kernel(x: jax.Array, plan: Plan) -> jax.Array:
    """``[B, T, H, D]`` -> ``[B * H, L, D]`` in the chunk-aligned layout (zeros on padding)."""
    b, t, h, d = x.shape
    if plan.src is not None:
        x = jnp.take(x, plan.src, axis=1, mode="fill", fill_value=0)
    else:
        x = jnp.pad(x, ((0, 0), (0, plan.length - t), (0, 0), (0, 0)))
    return x.transpose(0, 2, 1, 3).reshape(b * h, plan.length, d)


def _from_kernel(y: jax.Array, b: int, t: int, plan: Plan) -> jax.Array:
    """``[B * H, L, D]`` -> ``[B, T, H, D]`` (zeros for tokens outside every packed sequence)."""
    y = y.reshape(b, -1, plan.length, y.shape[-1]).transpose(0, 2, 1, 3)
    if plan.dst is not None:
        return jnp.take(y, plan.dst, axis=1, mode="fill", fill_value=0)
    return y[:, :t]


def _where_nonempty(plan: Plan, x: jax.Array, other: jax.Array) -> jax.Array:
    """Per sequence ``[N, H, K, V]``: ``x`` for sequences with tokens, ``other`` for empty ones."""
    if plan.nonempty is None:
        return x
    return jnp.where(plan.nonempty[:, None, None, None], x, other)


# ---- the differentiable op ------------------------------------------------------------------------


def _gla(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    h0: jax.Array,
    cu_seqlens: jax.Array | None,
    *,
    scale: float,
    fwd_chunk: int,
    bwd_chunk: int,
    interpret: Any,
) -> tuple[jax.Array, jax.Array]:
    """``(o [B, T, H, V], final state [B or N, H, K, V] float32)``; ``h0`` float32."""
    b, t, h, dk = q.shape

    def run_forward(chunk: int, q: Any, k: Any, v: Any, g: Any, h0: Any, cu: Any, save: bool) -> Any:
        plan = _plan(t, chunk, cu)
        out = forward(
            Geometry(chunk, scale), plan.flags, plan.seq, _to_kernel(q, plan), _to_kernel(k, plan),
            _to_kernel(v, plan), _to_kernel(g.astype(F32), plan), h0.reshape(-1, *h0.shape[2:]), save, interpret,
        )  # fmt: skip
        o = _from_kernel(out[0], b, t, plan)
        final = _where_nonempty(plan, out[1].reshape(h0.shape), h0)
        return o, final, (out[2] if save else None)

    @jax.custom_vjp
    def run(q: Any, k: Any, v: Any, g: Any, h0: Any, cu: Any) -> Any:
        return run_forward(fwd_chunk, q, k, v, g, h0, cu, save=False)[:2]

    def fwd(q: Any, k: Any, v: Any, g: Any, h0: Any, cu: Any) -> Any:
        o, final, states = run_forward(fwd_chunk, q, k, v, g, h0, cu, save=fwd_chunk == bwd_chunk)
        return (o, final), (q, k, v, g, h0, cu, states)

    def bwd(res: Any, cotangents: Any) -> Any:
        q, k, v, g, h0, cu, states = res
        do, dfinal = cotangents
        if states is None:  # another chunk for the backward: the states at its chunk boundaries
            states = run_forward(bwd_chunk, q, k, v, g, h0, cu, save=True)[2]
        plan = _plan(t, bwd_chunk, cu)
        dfinal = dfinal.astype(F32)
        dq, dk_, dv, dg, dh0 = backward(
            Geometry(bwd_chunk, scale), plan.flags, plan.seq, _to_kernel(q, plan), _to_kernel(k, plan),
            _to_kernel(v, plan), _to_kernel(g.astype(F32), plan), _to_kernel(do.astype(q.dtype), plan), states,
            _where_nonempty(plan, dfinal, jnp.zeros_like(dfinal)).reshape(-1, *h0.shape[2:]), interpret,
        )  # fmt: skip
        dh0 = _where_nonempty(plan, dh0.reshape(h0.shape), dfinal)  # an empty sequence passes its state through
        grads = (_from_kernel(x, b, t, plan) for x in (dq, dk_, dv, dg))
        dq, dk_, dv, dg = (x.astype(y.dtype) for x, y in zip(grads, (q, k, v, g)))
        return dq, dk_, dv, dg, dh0, None

    run.defvjp(fwd, bwd)
    return run(q, k, v, g, h0, cu_seqlens)


def _make(interpret: Any) -> Any:
    def gla(
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        g: jax.Array,
        *,
        scale: float | None = None,
        initial_state: jax.Array | None = None,
        output_final_state: bool = False,
        cu_seqlens: jax.Array | None = None,
        fwd_params: GlaChunkParams | None = None,
        bwd_params: GlaChunkParams | None = None,
    ) -> tuple[jax.Array, jax.Array | None]:
        """Mosaic TPU gated linear attention; launch parameters: ``GlaChunkParams`` (the chunk, 16 to 128)."""
        fwd_p, bwd_p = coerce(GlaChunkParams, fwd_params), coerce(GlaChunkParams, bwd_params)
        q, k, v, g = (jnp.asarray(x) for x in (q, k, v, g))
        q, k = repeat_query_key_heads(q, k, v.shape[2])  # grouped value heads: one head count from here on
        b, t, h, dk = q.shape
        n = b if cu_seqlens is None else cu_seqlens.shape[0] - 1
        if initial_state is None:
            h0 = jnp.zeros((n, h, dk, v.shape[-1]), F32)
        else:
            h0 = jnp.asarray(initial_state)
        o, final = _gla(
            q, k, v, g, h0.astype(F32), None if cu_seqlens is None else jnp.asarray(cu_seqlens),
            scale=float(dk**-0.5 if scale is None else scale),
            fwd_chunk=chunk_size(None if fwd_p is None else fwd_p.chunk_size, t),
            bwd_chunk=chunk_size(None if bwd_p is None else bwd_p.chunk_size, t),
            interpret=interpret() if callable(interpret) else interpret,
        )  # fmt: skip
        return o, (final if output_final_state else None)

    return gla


gla = _make(False)
"""On a TPU: compiled by Mosaic."""
gla_interpret = _make(_interpret_params)
"""On a CPU: the same kernels in JAX's TPU interpret mode (tests; slow)."""

__all__ = ["candidate_cfgs", "gla", "gla_interpret", "heuristic_cfg", "supports"]
