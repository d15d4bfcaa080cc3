"""Plain XLA gated delta rule: the chunked form (training) or the recurrence (decoding), see ``_chunked``.

Gradients: a ``jax.custom_vjp`` keeps only the inputs; the backward recomputes the forward with the
backward's chunk size and differentiates it (reverse mode through the chunk scan). So between the
forward and the backward nothing but the inputs is held, and during the backward the memory is the
scan's residuals: one ``[K, V]`` state per chunk and head plus ``O(T C)`` per head for the ``C x C``
chunk matrices (``T / C`` states of ``K V`` floats: with C = 64 and K = V = 128, 256 floats per token
and head). The recurrence (chunk size 1) keeps a state per token instead, so it is meant for short
sequences and decoding.

Grouped value heads (``HV`` a multiple of ``H``): ``q`` and ``k`` are repeated to the value heads inside the
compiled program, outside the ``custom_vjp`` (``repeat_query_key_heads``), so the chunked form sees one head
count and the gradients of ``q`` and ``k`` sum over each group (the repeat's transpose).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax

from ejkernel.kernels.signatures._linear_attention import repeat_query_key_heads

from ejkernel_xla.gated_delta_rule._chunked import Options, forward
from ejkernel_xla.params import DeltaRuleParams, coerce

# Measured on CPU (B=1, T=2048, H=4, K=V=64, float32), forward / forward+backward: chunk 64 took 16 / 159 ms,
# 32: 29 / 155, 16: 37 / 150, 128: 52 / 193, and the recurrence 54 / 911.
DEFAULT_CHUNK = 64
CANDIDATE_CHUNKS = (16, 32, 64, 128)
RECURRENT_UP_TO = 8  # sequences (on average) at most this long run the recurrence by default


def _mean_length(t: int, cu_seqlens: Any) -> float:
    """The mean sequence length: T, or T / N for N packed sequences."""
    return float(t) if cu_seqlens is None else t / max(1, cu_seqlens.shape[0] - 1)


def _next_pow2(x: float) -> int:
    p = 1
    while p < x:
        p *= 2
    return p


def default_chunk(length: float) -> int:
    """1 (the recurrence) for short sequences; else a power of two up to 64, at least 16, near ``length``.

    ``length`` is the mean sequence length; a chunk near it keeps the padding of packed sequences (each
    starts a chunk) small.
    """
    if length <= RECURRENT_UP_TO:
        return 1
    return max(16, min(DEFAULT_CHUNK, _next_pow2(length)))


def _inv_length(inv: Any) -> float:
    return _mean_length(inv.arguments["q"].shape[1], inv.arguments.get("cu_seqlens"))


def heuristic_cfg(inv: Any, stage: str) -> DeltaRuleParams:
    return DeltaRuleParams(chunk_size=default_chunk(_inv_length(inv)))


def candidate_cfgs(inv: Any, stage: str) -> list[DeltaRuleParams]:
    length = _inv_length(inv)
    chunks = [default_chunk(length)]
    chunks += [c for c in CANDIDATE_CHUNKS if c <= max(16, _next_pow2(length))]
    if length <= 64:
        chunks.append(1)
    return [DeltaRuleParams(chunk_size=c) for c in dict.fromkeys(chunks)]


def _chunk(params: Any, fallback: int) -> int:
    """The chunk size of ``params`` (a ``DeltaRuleParams``, checked when made; or generic, mapped), else ``fallback``."""
    p = coerce(DeltaRuleParams, params)
    return fallback if p is None or p.chunk_size is None else p.chunk_size


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gated_delta_rule(opts: Options, *args: Any) -> Any:
    return forward(opts, opts.fwd_chunk, *args)


def _fwd(opts: Options, *args: Any) -> Any:
    return forward(opts, opts.fwd_chunk, *args), args


def _bwd(opts: Options, args: Any, ct: Any) -> Any:
    _, vjp = jax.vjp(partial(forward, opts, opts.bwd_chunk), *args)
    return vjp(ct)


_gated_delta_rule.defvjp(_fwd, _bwd)


def _grouped(opts: Options, q: Any, k: Any, v: Any, *rest: Any) -> Any:
    """Grouped value heads: ``q``, ``k`` repeated to ``v``'s heads, then the one-head-count op."""
    q, k = repeat_query_key_heads(q, k, v.shape[2])
    return _gated_delta_rule(opts, q, k, v, *rest)


# Compiled as one program also when called eagerly (op-by-op dispatch of the scans is slow to start).
_run = jax.jit(_grouped, static_argnums=(0,))


def gated_delta_rule(
    q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
    use_qk_l2norm=False, fwd_params=None, bwd_params=None,
):  # fmt: skip
    """Chunked gated delta rule (contract: ``ejkernel.modules.operations.gated_delta_rule``).

    ``fwd_params``/``bwd_params``: ``DeltaRuleParams`` (``ejkernel_xla.params``), the chunk size of the
    forward and of the backward's recomputation (1: the token-by-token recurrence; None: ``default_chunk``,
    the backward: the forward's).
    """
    fwd_chunk = _chunk(fwd_params, default_chunk(_mean_length(q.shape[1], cu_seqlens)))
    opts = Options(
        scale=float(q.shape[-1] ** -0.5 if scale is None else scale),
        output_final_state=bool(output_final_state),
        use_qk_l2norm=bool(use_qk_l2norm),
        fwd_chunk=fwd_chunk,
        bwd_chunk=_chunk(bwd_params, fwd_chunk),
    )
    return _run(opts, q, k, v, g, beta, initial_state, cu_seqlens)


__all__ = ["candidate_cfgs", "default_chunk", "gated_delta_rule", "heuristic_cfg"]
