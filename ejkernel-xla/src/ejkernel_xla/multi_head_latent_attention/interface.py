"""Plain XLA multi-head latent attention: blockwise, O(T) memory forward and backward, dense and paged.

The kernel is ``_blockwise`` (online softmax over key blocks read in place, causal block skipping,
``custom_vjp`` with ``(out, lse)`` residuals). Flash attention's blockwise kernel could serve the
dense variant as MQA with ``value = key[..., :Dl]``, but it copies the keys into its block layout
on every call: a decode step (B=4, H=16, S=4096, D=576) took 207 ms that way on a 2-core CPU, 7.5 ms
here (DeepSeek's H=128: 25 ms, the dense reference 180 ms).

Blocks: ``FwdParams``/``BwdParams`` ``q_blocksize`` (query rows) and ``kv_blocksize`` (keys; paged:
rounded down to whole pages, at least one page).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from ejkernel.modules.operations.multi_head_latent_attention import resolve_latent_dim
from ejkernel.ops.utils.datacarrier import BwdParams, FwdParams

from ejkernel_xla.multi_head_latent_attention._blockwise import Options, attention

# Measured on a 2-core CPU (float32, Dl=512, Dr=64, B in 1..16, H in 16..128, T=1 decode and T=S=1024
# prefill): a step is fastest while the score tile ``B*H*bq*bk``, the float32 accumulator ``B*H*bq*Dl``
# and the key block ``B*bk*D`` each stay within 2**20 elements (4 MiB in float32; past that, decode got
# 3-10x slower). The query block starts at 256 rows, the key block at 2048 keys, halved until they fit.
MAX_BLOCKS = (256, 2048)
TILE_ELEMENTS = 1 << 20
MIN_Q_BLOCK, MIN_KV_BLOCK = 16, 64
# Around the heuristic (q, kv) blocks: these factors, clipped to the lengths, duplicates dropped.
_CANDIDATE_FACTORS = ((1, 1), (1, 2), (2, 1), (1, 0.5), (0.5, 1), (0.5, 0.5), (2, 2))


def default_blocks(b: int, h: int, t: int, s: int, d: int, dl: int) -> tuple[int, int]:
    """Heuristic ``(q_blocksize, kv_blocksize)`` for batch ``b``, ``h`` heads, ``t`` queries, ``s`` keys,
    query/key dim ``d`` and latent dim ``dl`` (both passes)."""
    bq, bk = min(MAX_BLOCKS[0], max(1, t)), MAX_BLOCKS[1]
    while b * h * bq * dl > TILE_ELEMENTS and bq > MIN_Q_BLOCK:
        bq //= 2
    while (b * h * bq * bk > TILE_ELEMENTS or b * bk * d > TILE_ELEMENTS) and bk > MIN_KV_BLOCK:
        bk //= 2
    return bq, max(1, min(bk, s))


def _dims(inv: Any) -> tuple[int, int, int, int, int, int]:
    b, t, h, d = (int(x) for x in inv.arguments["query"].shape)
    kv = inv.arguments["kv"]
    tables = inv.arguments.get("block_tables")
    s = int(kv.shape[1]) if tables is None else int(tables.shape[1]) * int(kv.shape[1])
    return b, h, t, s, d, resolve_latent_dim(inv.arguments.get("latent_dim"), d)


def heuristic_cfg(inv: Any, stage: str) -> FwdParams | BwdParams:
    bq, bk = default_blocks(*_dims(inv))
    cls = FwdParams if stage == "fwd" else BwdParams
    return cls(q_blocksize=bq, kv_blocksize=bk)


def candidate_cfgs(inv: Any, stage: str) -> list[FwdParams | BwdParams]:
    b, h, t, s, d, dl = _dims(inv)
    bq, bk = default_blocks(b, h, t, s, d, dl)
    cls = FwdParams if stage == "fwd" else BwdParams
    out: list[FwdParams | BwdParams] = []
    for fq, fk in _CANDIDATE_FACTORS:
        cfg = cls(q_blocksize=min(t, max(1, int(bq * fq))), kv_blocksize=min(s, max(16, int(bk * fk))))
        if cfg not in out:
            out.append(cfg)
    return out


def _blocks(params: Any, default: tuple[int, int]) -> tuple[int, int]:
    if params is None:
        return default
    return (params.q_blocksize or default[0], params.kv_blocksize or default[1])


def multi_head_latent_attention(
    query, kv, *, latent_dim=None, softmax_scale=None, causal=False, block_tables=None, cache_seqlens=None,
    fwd_params=None, bwd_params=None,
):  # fmt: skip
    """Blockwise MLA (contract: ``ejkernel.modules.operations.multi_head_latent_attention``).

    ``fwd_params``/``bwd_params``: ``q_blocksize``/``kv_blocksize`` of the forward and backward
    (None: ``default_blocks``); ``num_warps``/``num_stages`` mean nothing here.
    """
    b, t, h, d = query.shape
    dl = resolve_latent_dim(latent_dim, d)
    if (block_tables is None) != (cache_seqlens is None):
        raise ValueError("multi_head_latent_attention: the paged variant needs both block_tables and cache_seqlens")
    s = kv.shape[1] if block_tables is None else block_tables.shape[1] * kv.shape[1]
    if s == 0 or t == 0:
        return jnp.zeros((b, t, h, dl), query.dtype)  # no keys (or no queries): nothing to attend
    default = default_blocks(b, h, t, s, d, dl)
    o = Options(
        latent_dim=dl,
        scale=float(d**-0.5 if softmax_scale is None else softmax_scale),
        causal=bool(causal),
        fwd_blocks=_blocks(fwd_params, default),
        bwd_blocks=_blocks(bwd_params, default),
    )
    return attention(o, query, kv, block_tables, cache_seqlens)


__all__ = ["candidate_cfgs", "default_blocks", "heuristic_cfg", "multi_head_latent_attention"]
