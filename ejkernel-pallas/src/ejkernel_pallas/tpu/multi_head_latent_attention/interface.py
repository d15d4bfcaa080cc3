"""Mosaic TPU ``multi_head_latent_attention`` for decode (contract:
``ejkernel.modules.operations.multi_head_latent_attention``; alias ``flash_mla``).

Serves the dense (``kv [B, S, D]``) and the paged (``kv [P, page, D]`` with ``block_tables`` and
``cache_seqlens``) variants, causal or not, any ``softmax_scale`` and ``latent_dim``, in float32 and
bfloat16, for decode and speculative decode: ``T <= MAX_QUERIES`` queries per sequence. The ``T * H``
query rows of a sequence are one tile against each key block of the shared latent (see ``_kernels``),
so the cache is read once for every head.

Declines (``supports``): float16, which the TPU does not compute in, and ``T > MAX_QUERIES`` (prefill
and training: the XLA kernel or a flash kernel serve them; this one would re-read the latent for every
tile of ``bq`` query rows).

Gradients (query and latent, dense and paged): ``jax.custom_vjp`` keeps ``(out, lse)`` and runs one
Pallas backward kernel that recomputes the probabilities block by block, accumulates ``dQ`` and writes
each block's ``dKV`` (key role plus value role); XLA then sums those over query tiles and, when paged,
scatter-adds them at the pages read (pages may be shared between sequences), zeros elsewhere.

Launch parameters (``FwdParams``/``BwdParams``): ``q_blocksize``: query rows per tile, of the ``T * H``
rows (default: all of them up to 512 forward, 256 backward); ``kv_blocksize``: keys per block (default
512 forward, 256 backward, within an 8 MiB VMEM budget for the double-buffered key block; paged: whole
pages, at least one, at most 16). Both are rounded up to multiples of 16 forward (a bfloat16 vreg's rows)
and 128 backward (its transposed tiles), paged blocks by adding pages where 16 pages allow it.
``num_warps``/``num_stages`` mean nothing here.
"""

from __future__ import annotations

import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from ejkernel.device import cdiv, round_up
from ejkernel.modules.operations.multi_head_latent_attention import resolve_latent_dim
from ejkernel.ops.utils.datacarrier import BwdParams, FwdParams

from ejkernel_pallas.tpu.multi_head_latent_attention._kernels import F32, I32, Geometry, backward, forward

SUPPORTED_DTYPES = ("float32", "bfloat16")
MAX_QUERIES = 16  # queries per sequence served: decode and speculative decode
DEFAULT_ROWS = {"fwd": 512, "bwd": 256}  # query rows per tile
DEFAULT_KEYS = {"fwd": 512, "bwd": 256}  # keys per block
# Row tiles and key blocks are multiples of: 16 forward (a bfloat16 vreg's rows: Mosaic's matmul takes packed
# operands in whole tiles), 128 backward (the transposed tiles of dS^T Q and P^T dO, as in flash attention).
ALIGN = {"fwd": 16, "bwd": 128}
KV_VMEM_BYTES = 8 << 20  # the double-buffered key block
MAX_PAGES_PER_BLOCK = 16  # one block spec per page: more would mostly lengthen the kernel's prologue
# Keys per block worth timing; the backward holds more [bk, D] tiles (float32 dKV, dS^T Q) and stops earlier.
_CANDIDATE_KEYS = {"fwd": (128, 256, 512, 1024), "bwd": (128, 256, 512)}


def supports(inv: Any) -> str | None:
    """``None`` when this kernel serves ``inv``, else the reason it does not."""
    q = inv.arguments["query"]
    dtype = str(np.dtype(q.dtype))
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} (Mosaic TPU kernels take float32 or bfloat16)"
    t = int(q.shape[1])
    if t > MAX_QUERIES:
        return (
            f"T={t} queries per sequence: this is a decode kernel (T <= {MAX_QUERIES}); "
            "prefill/training: use the XLA or a flash kernel"
        )
    return None


def _tiles(rows: int, wanted: int | None, stage: str) -> tuple[int, int]:
    """``(bq, nr)``: rows per tile (a multiple of ``ALIGN[stage]``) and tiles, as even as that number allows."""
    align = ALIGN[stage]
    most = round_up(max(1, DEFAULT_ROWS[stage] if wanted is None else int(wanted)), align)
    nr = cdiv(max(rows, 1), most)
    return round_up(cdiv(max(rows, 1), nr), align), nr


def _keys(wanted: int | None, stage: str, d: int, dtype: Any) -> int:
    """Keys per block wanted, within the VMEM budget of the double-buffered ``[bk, D]`` block."""
    tokens = DEFAULT_KEYS[stage] if wanted is None else max(1, int(wanted))
    row_bytes = round_up(d, 128) * jnp.dtype(dtype).itemsize
    return max(1, min(tokens, KV_VMEM_BYTES // (2 * row_bytes)))


def _key_blocks(tokens: int, stage: str, paged: bool, s_or_page: int, maxp: int) -> tuple[int, int, int]:
    """``(bk, nk, ppb)`` for ``tokens`` keys per block wanted: dense ``S = s_or_page`` keys (``ppb = 0``;
    ``bk`` a multiple of ``ALIGN[stage]``, the one block of a short ``S`` reaching past it), or ``maxp``
    pages of ``page = s_or_page`` tokens (whole pages; as many more as make ``bk`` aligned, within
    ``MAX_PAGES_PER_BLOCK``; slots past the table re-read its last page read, masked)."""
    align = ALIGN[stage]
    if paged:
        page = s_or_page
        ppb = max(1, min(maxp, MAX_PAGES_PER_BLOCK, tokens // page))
        step = align // math.gcd(page, align)  # pages that make an aligned block
        if ppb % step and step <= MAX_PAGES_PER_BLOCK:
            ppb = round_up(ppb, step)
        return ppb * page, cdiv(maxp, ppb), ppb
    s = s_or_page
    bk = round_up(min(tokens, s), align)
    return bk, cdiv(s, bk), 0


def _dims(inv: Any) -> tuple[int, int, int, Any]:
    b, t, h, d = (int(x) for x in inv.arguments["query"].shape)
    return t * h, d, int(inv.arguments["kv"].shape[1]), np.dtype(inv.arguments["query"].dtype)


def heuristic_cfg(inv: Any, stage: str) -> FwdParams | BwdParams:
    rows, d, _, dtype = _dims(inv)
    cls = FwdParams if stage == "fwd" else BwdParams
    return cls(q_blocksize=_tiles(rows, None, stage)[0], kv_blocksize=_keys(None, stage, d, dtype))


def candidate_cfgs(inv: Any, stage: str) -> list[FwdParams | BwdParams]:
    rows, d, _, dtype = _dims(inv)
    cls = FwdParams if stage == "fwd" else BwdParams
    bq = _tiles(rows, None, stage)[0]
    out: list[FwdParams | BwdParams] = []
    for tokens in _CANDIDATE_KEYS[stage]:
        cfg = cls(q_blocksize=bq, kv_blocksize=_keys(tokens, stage, d, dtype))
        if cfg not in out:
            out.append(cfg)
    return out


def interpret_params() -> Any:
    """TPU interpret mode (on CPU, for tests); races are looked for when ``EJKERNEL_PALLAS_DETECT_RACES=1``."""
    return pltpu.InterpretParams(detect_races=os.environ.get("EJKERNEL_PALLAS_DETECT_RACES") == "1")


def _pad_rows(x: jax.Array, rows: int) -> jax.Array:
    """``[B, R, W]`` -> ``[B, rows, W]`` (zeros below)."""
    return x if x.shape[1] == rows else jnp.pad(x, ((0, 0), (0, rows - x.shape[1]), (0, 0)))


def _attention(
    query: jax.Array,
    kv: jax.Array,
    tables: jax.Array | None,
    lens: jax.Array | None,
    *,
    latent_dim: int,
    scale: float,
    causal: bool,
    fwd_params: FwdParams,
    bwd_params: BwdParams,
    interpret: Any,
) -> jax.Array:
    b, t, h, d = query.shape
    rows, dl = t * h, latent_dim
    paged = tables is not None
    maxp = int(tables.shape[1]) if tables is not None else 0
    e = dl if dl % 128 == 0 else d  # the value width the kernels compute (see _kernels)

    def geometry(params: Any, stage: str) -> Geometry:
        bq, nr = _tiles(rows, params.q_blocksize, stage)
        tokens = _keys(params.kv_blocksize, stage, d, query.dtype)
        bk, nk, ppb = _key_blocks(tokens, stage, paged, int(kv.shape[1]), maxp)
        return Geometry(
            t=t, heads=h, bq=bq, nr=nr, bk=bk, nk=nk, pages=ppb, maxp=maxp, latent_dim=dl, value_dim=e,
            scale=scale, causal=causal,
        )  # fmt: skip

    geo_f, geo_b = geometry(fwd_params, "fwd"), geometry(bwd_params, "bwd")

    def schedule(geo: Geometry, kv: Any, tables: Any, lens: Any) -> tuple[jax.Array, jax.Array | None]:
        """The schedule and the flat page table (entries past the pages in use may hold anything: clipped)."""
        if tables is None:
            return geo.schedule(jnp.full((b,), kv.shape[1], I32)), None
        lengths = jnp.clip(lens.astype(I32), 0, maxp * kv.shape[1])
        return geo.schedule(lengths), jnp.clip(tables.astype(I32), 0, kv.shape[0] - 1).reshape(-1)

    def rows_of(x: jax.Array, geo: Geometry) -> jax.Array:
        """``[B, T, H, W]`` -> ``[B, Rp, W]``, row ``t * H + h``."""
        return _pad_rows(x.reshape(b, rows, x.shape[-1]), geo.padded_rows)

    # Tables and lengths are arguments, not closed over: custom_vjp functions must not capture traced values.
    @jax.custom_vjp
    def run(q: Any, kv: Any, tables: Any, lens: Any) -> Any:
        return fwd(q, kv, tables, lens)[0]

    def fwd(q: Any, kv: Any, tables: Any, lens: Any) -> Any:
        sched, flat = schedule(geo_f, kv, tables, lens)
        o, lse = forward(geo_f, sched, flat, rows_of(q, geo_f), kv, interpret)
        out = o[:, :rows, :dl].reshape(b, t, h, dl)
        return out, (q, kv, tables, lens, out, lse[:, :rows])

    def bwd(res: Any, g: Any) -> Any:
        q, kv, tables, lens, out, lse = res
        sched, flat = schedule(geo_b, kv, tables, lens)
        g = g.astype(q.dtype)
        delta = jnp.sum(g.astype(F32) * out.astype(F32), axis=-1).reshape(b, rows, 1)
        do = jnp.pad(g, ((0, 0), (0, 0), (0, 0), (0, e - dl)))  # zero past Dl: no value role there
        dq, dkv = backward(
            geo_b, sched, flat, rows_of(q, geo_b), kv, rows_of(do, geo_b), _pad_rows(lse, geo_b.padded_rows),
            _pad_rows(delta, geo_b.padded_rows), interpret,
        )  # fmt: skip
        dq = dq[:, :rows].reshape(b, t, h, d)
        dkv = dkv.sum(axis=1).reshape(b, geo_b.nk * geo_b.bk, d)  # over the query tiles
        if tables is None:
            return dq, dkv[:, : kv.shape[1]].astype(kv.dtype), None, None
        page = kv.shape[1]
        dkv = dkv.reshape(b, geo_b.nk * geo_b.pages, page, d)[:, :maxp]
        lengths = jnp.clip(lens.astype(I32), 0, maxp * page)
        used = jnp.arange(maxp)[None, :] < cdiv(lengths, page)[:, None]  # [B, maxp]: the columns read
        dkv = jnp.where(used[..., None, None], dkv, 0.0)
        pages = jnp.where(used, jnp.clip(tables.astype(I32), 0, kv.shape[0] - 1), 0)
        grad = jnp.zeros(kv.shape, F32).at[pages.reshape(-1)].add(dkv.reshape(-1, page, d))
        return dq, grad.astype(kv.dtype), None, None

    run.defvjp(fwd, bwd)
    return run(query, kv, tables, lens)


def _make(interpret: Any) -> Any:
    def multi_head_latent_attention(
        query: jax.Array,
        kv: jax.Array,
        *,
        latent_dim: int | None = None,
        softmax_scale: float | None = None,
        causal: bool = False,
        block_tables: jax.Array | None = None,
        cache_seqlens: jax.Array | None = None,
        fwd_params: FwdParams | None = None,
        bwd_params: BwdParams | None = None,
    ) -> jax.Array:
        """Mosaic TPU MLA decode; launch parameters: ``q_blocksize`` (query rows per tile, of ``T * H``) and
        ``kv_blocksize`` (keys per block; paged: whole pages)."""
        b, t, h, d = query.shape
        dl = resolve_latent_dim(latent_dim, d)
        if (block_tables is None) != (cache_seqlens is None):
            raise ValueError("multi_head_latent_attention: the paged variant needs both block_tables and cache_seqlens")
        s = kv.shape[1] if block_tables is None else block_tables.shape[1] * kv.shape[1]
        if s == 0 or t * h == 0 or b == 0:
            return jnp.zeros((b, t, h, dl), query.dtype)  # no keys (or no queries): nothing to attend
        tables = None if block_tables is None else jnp.asarray(block_tables)
        lens = None if cache_seqlens is None else jnp.asarray(cache_seqlens)
        return _attention(
            jnp.asarray(query), jnp.asarray(kv), tables, lens, latent_dim=dl, scale=float(d**-0.5 if softmax_scale is None else softmax_scale),
            causal=bool(causal), fwd_params=fwd_params or FwdParams(), bwd_params=bwd_params or BwdParams(),
            interpret=interpret() if callable(interpret) else interpret,
        )  # fmt: skip

    return multi_head_latent_attention


multi_head_latent_attention = _make(False)
"""On a TPU: compiled by Mosaic."""
multi_head_latent_attention_interpret = _make(interpret_params)
"""On a CPU: the same kernels in JAX's TPU interpret mode (tests; slow)."""

__all__ = [
    "candidate_cfgs",
    "heuristic_cfg",
    "multi_head_latent_attention",
    "multi_head_latent_attention_interpret",
    "supports",
]
