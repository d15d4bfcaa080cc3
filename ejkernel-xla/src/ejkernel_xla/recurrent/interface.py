"""Plain XLA ``recurrent``: the chunked linear-attention engine with scalar, key and value gates."""

from __future__ import annotations

import jax.numpy as jnp

from ejkernel_xla._linear_attention import F32, candidate_cfgs, heuristic_cfg, linear_attention, options


def recurrent(
    q, k, v, g=None, g_k=None, g_v=None, *, scale=None, initial_state=None, output_final_state=False,
    reverse=False, cu_seqlens=None, fwd_params=None, bwd_params=None,
):  # fmt: skip
    """The general gated linear-attention recurrence (contract: ``ejkernel.modules.operations.recurrent``).

    ``fwd_params``/``bwd_params``: ``ChunkParams`` (``ejkernel_xla.params``), the chunk length of each pass
    (a power of two; 1 = the step-by-step recurrence; None: the heuristic).
    """
    t, dk = q.shape[1], q.shape[-1]
    opts = options(
        t,
        dk**-0.5 if scale is None else scale,
        fwd_params,
        bwd_params,
        reverse=reverse,
        output_final_state=output_final_state,
    )
    # The scalar gate decays every entry of the state: fold it into the key-side gate (width 1 alone).
    log_decay_k = None if g is None else jnp.asarray(g).astype(F32)[..., None]
    if g_k is not None:
        g_k = jnp.asarray(g_k).astype(F32)
        log_decay_k = g_k if log_decay_k is None else log_decay_k + g_k
    return linear_attention(opts, q, k, v, log_decay_k, g_v, initial_state, cu_seqlens)


__all__ = ["candidate_cfgs", "heuristic_cfg", "recurrent"]
