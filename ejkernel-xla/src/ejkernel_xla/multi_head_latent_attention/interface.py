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

from ejkernel_xla._paged import on_cpu
from ejkernel_xla.multi_head_latent_attention._blockwise import Options, attention

# Measured on a 2-core CPU (float32, Dl=512, Dr=64, B in 1..16, H in 16..128, T=1 decode and T=S=1024
# prefill): a step is fastest while the score tile ``B*H*bq*bk``, the float32 accumulator ``B*H*bq*Dl``
# and the key block ``B*bk*D`` each stay within 2**20 elements (4 MiB in float32; past that, decode got
# 3-10x slower). The query block starts at 256 rows, the key block at 2048 keys, halved until they fit.
MAX_BLOCKS = (256, 2048)
TILE_ELEMENTS = 1 << 20
# On a GPU or TPU each key block is a loop step with a gather and launches of its own, and small steps leave the
# device idle (the CPU's blocks read the latent cache at 0.08 TB/s on the H200 at B64 H128 4096 keys): the key
# block starts at the whole sequence, the score tile and the accumulator may hold 2**26 elements (256 MiB in
# float32) and the gathered key block 2**28 (512 MiB in bfloat16: as much as a naive gather of the pages). A decode
# step of DeepSeek-V3 at B64 H128 4096 keys (33.5M scores, 151M latents) or B1 x 32768 keys is then one step, which
# the kernel takes without a loop. Not yet timed on a GPU.
ACCELERATOR_ELEMENTS = (1 << 26, 1 << 28)
MIN_Q_BLOCK, MIN_KV_BLOCK = 16, 64
# Around the heuristic (q, kv) blocks: these factors, clipped to the lengths, duplicates dropped.
_CANDIDATE_FACTORS = ((1, 1), (1, 2), (2, 1), (1, 0.5), (0.5, 1), (0.5, 0.5), (2, 2))


def default_blocks(b: int, h: int, t: int, s: int, d: int, dl: int, backend: str | None = None) -> tuple[int, int]:
    """Heuristic ``(q_blocksize, kv_blocksize)`` for batch ``b``, ``h`` heads, ``t`` queries, ``s`` keys,
    query/key dim ``d`` and latent dim ``dl`` (both passes), on ``backend`` (``"cpu"``, ``"gpu"``, ``"tpu"``;
    None: JAX's default backend).

    >>> default_blocks(64, 128, 1, 4096, 576, 512, "cpu")  # DeepSeek-V3 decode on a CPU: 64 steps of 64 keys
    (1, 64)
    >>> default_blocks(64, 128, 1, 4096, 576, 512, "gpu")  # on a GPU: one step
    (1, 4096)
    """
    if on_cpu(backend):
        tile = kv_tile = TILE_ELEMENTS
        bk = MAX_BLOCKS[1]
    else:
        tile, kv_tile = ACCELERATOR_ELEMENTS
        bk = max(1, s)
    bq = min(MAX_BLOCKS[0], max(1, t))
    while b * h * bq * dl > tile and bq > MIN_Q_BLOCK:
        bq //= 2
    while (b * h * bq * bk > tile or b * bk * d > kv_tile) and bk > MIN_KV_BLOCK:
        bk //= 2
    return bq, max(1, min(bk, s))


def _dims(inv: Any) -> tuple[int, int, int, int, int, int]:
    b, t, h, d = (int(x) for x in inv.arguments["query"].shape)
    kv = inv.arguments["kv"]
    tables = inv.arguments.get("block_tables")
    s = int(kv.shape[1]) if tables is None else int(tables.shape[1]) * int(kv.shape[1])
    return b, h, t, s, d, resolve_latent_dim(inv.arguments.get("latent_dim"), d)


def heuristic_cfg(inv: Any, stage: str) -> FwdParams | BwdParams:
    bq, bk = default_blocks(*_dims(inv), inv.backend)
    cls = FwdParams if stage == "fwd" else BwdParams
    return cls(q_blocksize=bq, kv_blocksize=bk)


def candidate_cfgs(inv: Any, stage: str) -> list[FwdParams | BwdParams]:
    b, h, t, s, d, dl = _dims(inv)
    bq, bk = default_blocks(b, h, t, s, d, dl, inv.backend)
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
    default = default_blocks(b, h, t, s, d, dl, None)
    o = Options(
        latent_dim=dl,
        scale=float(d**-0.5 if softmax_scale is None else softmax_scale),
        causal=bool(causal),
        fwd_blocks=_blocks(fwd_params, default),
        bwd_blocks=_blocks(bwd_params, default),
    )
    return attention(o, query, kv, block_tables, cache_seqlens)


__all__ = ["candidate_cfgs", "default_blocks", "heuristic_cfg", "multi_head_latent_attention"]
