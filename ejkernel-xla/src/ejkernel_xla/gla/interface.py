"""Plain XLA ``gla``: the chunked linear-attention engine (``ejkernel_xla._linear_attention``).

Grouped value heads (``HV`` a multiple of ``H``): ``q`` and ``k`` are repeated to the value heads first
(``repeat_query_key_heads``), so the engine sees one head count; their gradients sum over each group.
"""

from __future__ import annotations

from ejkernel.kernels.signatures._linear_attention import repeat_query_key_heads

from ejkernel_xla._linear_attention import candidate_cfgs, heuristic_cfg, linear_attention, options


def gla(
    q, k, v, g, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
    fwd_params=None, bwd_params=None,
):  # fmt: skip
    """Gated linear attention (contract: ``ejkernel.modules.operations.gla``).

    ``fwd_params``/``bwd_params``: ``ChunkParams`` (``ejkernel_xla.params``), the chunk length of each pass
    (a power of two; 1 = the step-by-step recurrence; None: the heuristic).
    """
    t, dk = q.shape[1], q.shape[-1]
    opts = options(
        t, dk**-0.5 if scale is None else scale, fwd_params, bwd_params, output_final_state=output_final_state
    )
    q, k = repeat_query_key_heads(q, k, v.shape[2])
    return linear_attention(opts, q, k, v, g, None, initial_state, cu_seqlens)


__all__ = ["candidate_cfgs", "gla", "heuristic_cfg"]
