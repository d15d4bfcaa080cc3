"""In-test plugins: implementations of ``flash_attention`` whose cost is set by their launch parameters.

``num_stages`` of the forward (backward) params is how many ``D x D`` matmuls the forward (backward)
runs per row, so a candidate with 64 stages does 64x the work of one with 1: the autotuner must
find the cheap one whether it is called eagerly or under ``jit``, ``grad`` or ``vmap``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ejkernel.kernels.params import BwdParams, FwdParams
from ejkernel.plugins import hookimpl

FWD_CANDIDATES = [FwdParams(num_stages=40), FwdParams(num_stages=1), FwdParams(num_stages=20)]
BWD_CANDIDATES = [BwdParams(num_stages=40), BwdParams(num_stages=2), BwdParams(num_stages=20)]
calls: list[tuple[FwdParams | None, BwdParams | None]] = []


def _work(x: jax.Array, reps: int) -> jax.Array:
    m = jnp.eye(x.shape[-1], dtype=x.dtype) * 0.5
    return jax.lax.fori_loop(0, reps, lambda i, y: jnp.tanh(y @ m + 0.1), x)


def _attention_with_costs(query, fwd_reps: int, bwd_reps: int):
    """``query`` through ``fwd_reps`` rounds of work forward and ``bwd_reps`` backward."""

    @jax.custom_vjp
    def f(q):
        return _work(q, fwd_reps)

    def f_fwd(q):
        return _work(q, fwd_reps), None

    def f_bwd(_, g):
        return (_work(g, bwd_reps),)

    f.defvjp(f_fwd, f_bwd)
    return f(query)


def costly_attention(
    query,
    key,
    value,
    bias=None,
    *,
    attention_mask=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    softmax_scale=None,
    causal=False,
    sliding_window=None,
    logits_soft_cap=None,
    dropout_prob=0.0,
    dropout_seed=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    kv_lengths=None,
    prefix_lengths=None,
    fwd_params=None,
    bwd_params=None,
):
    calls.append((fwd_params, bwd_params))
    fwd_reps = (fwd_params or FwdParams(num_stages=4)).num_stages
    bwd_reps = (bwd_params or BwdParams(num_stages=4)).num_stages
    return _attention_with_costs(query, fwd_reps, bwd_reps)


def lopsided_attention(
    query,
    key,
    value,
    bias=None,
    *,
    attention_mask=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    softmax_scale=None,
    causal=False,
    sliding_window=None,
    logits_soft_cap=None,
    dropout_prob=0.0,
    dropout_seed=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    fwd_params=None,
    bwd_params=None,
):
    """The fastest forward of all (no work) with the slowest backward (80 rounds), whatever the params."""
    return _attention_with_costs(query, 0, 80)


def heuristic(inv, stage):
    return FwdParams(num_stages=4) if stage == "fwd" else BwdParams(num_stages=4)


def candidates(inv, stage):
    return FWD_CANDIDATES if stage == "fwd" else BWD_CANDIDATES


def refuse_soft_cap(inv):
    return "logits_soft_cap is not supported" if inv.arguments["logits_soft_cap"] is not None else None


class CostlyPlugin:
    """Registers ``costly_attention`` as platform ``costly`` for every backend."""

    @hookimpl
    def ejkernel_register_kernels(self, registry):
        registry.register(
            "flash_attention",
            "costly",
            "any",
            priority=1000,
            impl=costly_attention,
            heuristic_cfg=heuristic,
            candidate_cfgs=candidates,
            supports=refuse_soft_cap,
            version="1.0",
        )


class LopsidedPlugin:
    """Registers ``lopsided_attention`` as platform ``lopsided`` (below ``costly``'s priority)."""

    @hookimpl
    def ejkernel_register_kernels(self, registry):
        registry.register(
            "flash_attention",
            "lopsided",
            "any",
            priority=10,
            impl=lopsided_attention,
            heuristic_cfg=heuristic,
            candidate_cfgs=lambda inv, stage: [heuristic(inv, stage)],
            version="1.0",
        )
