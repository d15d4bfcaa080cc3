"""Plain XLA ``lightning_attn``: the chunked linear-attention engine with one decay per head."""

from __future__ import annotations

import jax.numpy as jnp

from ejkernel_xla._linear_attention import F32, candidate_cfgs, heuristic_cfg, linear_attention, options


def lightning_attn(
    q, k, v, slope, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
    fwd_params=None, bwd_params=None,
):  # fmt: skip
    """Linear attention decaying by ``exp(-slope[h])`` per step (contract: ``ejkernel.modules.operations.lightning_attn``).

    ``fwd_params``/``bwd_params``: ``ChunkParams`` (``ejkernel_xla.params``), the chunk length of each pass
    (a power of two; 1 = the step-by-step recurrence; None: the heuristic).
    """
    b, t, h, dk = q.shape
    opts = options(
        t, dk**-0.5 if scale is None else scale, fwd_params, bwd_params, output_final_state=output_final_state
    )
    # One log decay for the whole state of each head: a key-side gate of width 1.
    log_decay = jnp.broadcast_to(-jnp.asarray(slope).astype(F32)[:, None], (b, t, h, 1))
    return linear_attention(opts, q, k, v, log_decay, None, initial_state, cu_seqlens)


__all__ = ["candidate_cfgs", "heuristic_cfg", "lightning_attn"]
