"""Plain XLA ring attention: blockwise flash attention per shard pair, keys/values passed round the ring."""

from __future__ import annotations

from typing import Any

from ejkernel.kernels.signatures.flash_attention import normalize_window
from ejkernel.kernels.signatures.ring_attention import check_layout, ring_axis_size

from ejkernel_xla.flash_attention.interface import candidate_cfgs, heuristic_cfg
from ejkernel_xla.ring_attention._ring import RingOptions
from ejkernel_xla.ring_attention._ring import ring_attention as _ring_attention

# The launch parameters are flash attention's over the local lengths (heuristic_cfg, candidate_cfgs):
# each shard pair is one blockwise attention of T local queries against S visiting keys.


def _blocks(params: Any) -> tuple[int | None, int | None]:
    if params is None:
        return (None, None)
    return (params.q_blocksize, params.kv_blocksize)


def ring_attention(
    query, key, value, *, q_segment_ids=None, kv_segment_ids=None, softmax_scale=None, causal=False,
    sliding_window=None, logits_soft_cap=None, axis_name=None, layout="contiguous", fwd_params=None, bwd_params=None,
):  # fmt: skip
    """Ring attention (contract: ``ejkernel.kernels.signatures.ring_attention``).

    ``fwd_params``/``bwd_params``: ``q_blocksize``/``kv_blocksize`` of the tiles of each shard pair in
    the forward and backward (None: ``default_blocks`` of the local lengths).
    """
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("ring_attention: pass both q_segment_ids and kv_segment_ids, or neither")
    n = ring_axis_size(axis_name)
    check_layout(layout, n, query.shape[1], "the local query length T")
    check_layout(layout, n, key.shape[1], "the local key length S")
    opts = RingOptions(
        scale=float(query.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale),
        causal=bool(causal),
        window=normalize_window(sliding_window),
        soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        axis_name=axis_name,
        layout=layout if n > 1 else "contiguous",
        fwd_blocks=_blocks(fwd_params),
        bwd_blocks=_blocks(bwd_params),
    )
    return _ring_attention(opts, query, key, value, q_segment_ids, kv_segment_ids)


__all__ = ["candidate_cfgs", "heuristic_cfg", "ring_attention"]
