"""XLA ``block_sparse_attention``: visits only the key tiles the block mask admits (see ``_core``)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from ejkernel.modules.operations.block_sparse_attention import block_sparse_mask
from ejkernel.ops.utils.datacarrier import BwdParams, FwdParams

from ejkernel_xla.block_sparse_attention._core import Options, attention, default_tiles

# Without a mask (dense or causal only): flash attention's factors around the heuristic blocks.
_DENSE_FACTORS = ((1, 1), (1, 2), (2, 1), (1, 0.5), (0.5, 1), (2, 2))
# With a mask: tiles of (q, kv) mask blocks. Bigger tiles batch more work per step but admit a
# pair when any of its blocks is admitted, so they only pay off on dense or clustered masks.
_MASK_MULTIPLES = ((1, 1), (2, 1), (2, 2), (4, 4))


def _masked(args: Any) -> bool:
    return args["block_mask"] is not None or args["local_blocks"] is not None or bool(args["global_blocks"])


def _dims(inv: Any) -> tuple[int, int, int, int, int, int, bool]:
    a = inv.arguments
    b, t, h, _ = a["query"].shape
    s = a["key"].shape[1]
    return int(b), int(h), int(t), int(s), int(a["q_block"]), int(a["kv_block"]), _masked(a)


def heuristic_cfg(inv: Any, stage: str) -> FwdParams | BwdParams:
    b, h, t, s, qb, kb, masked = _dims(inv)
    tq, tk = default_tiles(b, h, t, s, qb, kb, masked)
    cls = FwdParams if stage == "fwd" else BwdParams
    return cls(q_blocksize=tq, kv_blocksize=tk)


def candidate_cfgs(inv: Any, stage: str) -> list[FwdParams | BwdParams]:
    b, h, t, s, qb, kb, masked = _dims(inv)
    cls = FwdParams if stage == "fwd" else BwdParams
    if masked:
        sizes = [(qb * fq, kb * fk) for fq, fk in _MASK_MULTIPLES]
    else:
        tq, tk = default_tiles(b, h, t, s, qb, kb, masked)
        sizes = [(max(16, int(tq * fq)), max(16, int(tk * fk))) for fq, fk in _DENSE_FACTORS]
    out: list[FwdParams | BwdParams] = [heuristic_cfg(inv, stage)]
    for fq, fk in sizes:
        cfg = cls(q_blocksize=min(fq, -(-t // qb) * qb), kv_blocksize=min(fk, -(-s // kb) * kb))
        if cfg not in out:
            out.append(cfg)
    return out


def _tiles(params: Any) -> tuple[int | None, int | None]:
    return (None, None) if params is None else (params.q_blocksize, params.kv_blocksize)


def block_sparse_attention(
    query, key, value, *, block_mask=None, q_segment_ids=None, kv_segment_ids=None, q_block=64, kv_block=64,
    local_blocks=None, global_blocks=0, causal=False, softmax_scale=None, logits_soft_cap=None,
    fwd_params=None, bwd_params=None,
):  # fmt: skip
    """Block-sparse attention (contract: ``ejkernel.modules.operations.block_sparse_attention``).

    ``fwd_params``/``bwd_params``: ``q_blocksize``/``kv_blocksize`` are the compute tiles in tokens,
    rounded to multiples of ``q_block``/``kv_block`` when a mask is in play (None: ``default_tiles``).
    """
    t, s = query.shape[1], key.shape[1]
    if block_mask is None and (local_blocks is not None or global_blocks):
        pattern = block_sparse_mask(
            t, s, q_block=q_block, kv_block=kv_block, local_blocks=local_blocks, global_blocks=global_blocks,
            causal=causal,
        )  # fmt: skip
        if not pattern.all():
            block_mask = jnp.asarray(pattern[None, None])
    masked = block_mask is not None
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("block_sparse_attention: pass both q_segment_ids and kv_segment_ids, or neither")
    opts = Options(
        scale=float(query.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale),
        soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        causal=bool(causal),
        offset=s - t,
        q_block=int(q_block) if masked else 1,
        kv_block=int(kv_block) if masked else 1,
        fwd_tiles=_tiles(fwd_params),
        bwd_tiles=_tiles(bwd_params),
    )
    return attention(opts, query, key, value, block_mask, q_segment_ids, kv_segment_ids)


__all__ = ["block_sparse_attention", "candidate_cfgs", "heuristic_cfg"]
