"""Mosaic TPU multi-head latent attention kernels for decode: the forward and a fused backward (dQ and dKV).

Shapes: B batch, T queries per sequence, H heads, R = T * H query rows, D = Dl + Dr the query/key dim,
E the value width the kernels compute (``Dl`` when it is a multiple of 128, else ``D``: see below),
``bq`` rows per query tile (``nr`` tiles), ``bk`` keys per key block (``nk`` blocks); paged: ``page``
tokens per page, ``ppb`` pages per key block, ``maxp`` table columns.

Why all heads in one tile. Every head attends the same latent ``kv [*, D]``, so the queries of all heads
and all ``T`` positions of a sequence are rows of one ``[R, D]`` tile (row ``r`` is query ``r // H``,
head ``r % H``): one key block read from HBM serves every head with one ``[R, D] x [D, bk]`` matmul.
A decode step (``T`` of 1 to a few tokens) is memory bound on the latent cache, and this reads it once.

Grid ``(B, nr, nk)``: sequences and query tiles are independent ("parallel"), the key blocks are the
online-softmax reduction ("arbitrary", last). Per ``(b, i)`` the wrapper precomputes by scalar prefetch
(SMEM, ``FIELDS``) the sequence length ``L``, the end of the keys any row of the tile admits
(``L``, or with ``causal`` the last row's diagonal), the number of visible key blocks and the last table
column read. A step past them does no work and its index maps clamp to the last visible block (or
page), so the pipeline keeps the resident block instead of fetching one: pages past the length cost
neither a DMA nor compute. A paged key block is ``ppb`` block specs, one per page, whose index maps read
the page table (also by scalar prefetch; flattened, as a 2-D SMEM array would pad its rows to 128
entries), so the cache is never gathered or copied by XLA.

Masking. A ``[bq, 1]`` int32 input holds each row's limit relative to the length: row ``r`` admits key
``j`` iff ``j <= L + limit[r]`` (``-1`` without causal, ``r // H - T`` with causal, a huge negative for
padding rows), which needs no integer division in the kernel. Cache rows at or past the tile's key end
may hold anything, NaN included (the rest of the last page, the overhang of a dense block past ``S``):
in the block that reaches past the end they are zeroed before either product, so that their zero
probabilities cannot turn into NaN. Statistics and accumulators are float32 VMEM scratch, the
statistics replicated over the 128 lanes (the TPU's layout for a per-row value).

Values. The value is the latent's first ``Dl`` dims. When ``Dl`` is a multiple of 128 (DeepSeek's 512)
the kernels slice it from the key block on a lane boundary; otherwise they use all ``D`` dims as the
value and the wrapper drops the rotary columns of the output (a few percent more MXU work, no
unaligned lane slices).

Backward (one kernel, same grid): per step it recomputes ``P = exp(s - lse)``, ``dS = P * (dO V^T -
delta)``, accumulates ``dQ += dS K`` over the key blocks, and writes the key block's gradient
``scale * dS^T Q + [P^T dO, 0]`` (key role plus value role of the latent) for this query tile. Key
blocks may be shared between sequences (a paged shared prefix), so these per-(sequence, tile, block)
partials go to a float32 ``[B, nr, nk, bk, D]`` output that the wrapper sums over tiles and adds into
the cache's shape (a scatter-add at the pages read).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ejkernel.device import cdiv

F32 = jnp.float32
I32 = jnp.int32
LANES = 128
NO_KEYS = -(1 << 30)  # the row limit of a padding row: admits no key

# Per-(sequence, query tile) fields of the schedule (one flat int32 array in SMEM).
FIELDS = ("length", "end", "blocks", "last_col")
NF = len(FIELDS)
_F = {name: i for i, name in enumerate(FIELDS)}


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Static description of one pass (forward or backward) of a call."""

    t: int  # T
    heads: int  # H
    bq: int  # query rows per tile, a multiple of 16 (forward) or 128 (backward)
    nr: int  # query tiles
    bk: int  # keys per key block
    nk: int  # key blocks
    pages: int  # pages per key block (ppb); 0 for a dense kv
    maxp: int  # page-table columns; 0 for a dense kv
    latent_dim: int  # Dl
    value_dim: int  # E: Dl when a multiple of 128, else D
    scale: float
    causal: bool

    @property
    def rows(self) -> int:
        return self.t * self.heads

    @property
    def padded_rows(self) -> int:
        return self.nr * self.bq

    @property
    def page(self) -> int:
        return self.bk // self.pages

    def row_limits(self) -> np.ndarray:
        """``[Rp, 1]`` int32: row ``r`` admits keys ``j <= L + limit[r]``."""
        r = np.arange(self.padded_rows)
        limit = r // self.heads - self.t if self.causal else np.full_like(r, -1)
        return np.where(r < self.rows, limit, NO_KEYS).astype(np.int32)[:, None]

    def schedule(self, lengths: jax.Array) -> jax.Array:
        """The flat ``[B * nr * NF]`` schedule of ``lengths [B]`` (int32, already within ``[0, S]``)."""
        lengths = lengths.astype(I32)
        if self.causal:  # the last real row of tile i sees keys up to L + (its query index) - T
            last_row = np.minimum((np.arange(self.nr) + 1) * self.bq, self.rows) - 1
            offset = jnp.asarray(last_row // self.heads - self.t + 1, I32)
        else:
            offset = jnp.zeros((self.nr,), I32)
        length = jnp.broadcast_to(lengths[:, None], (lengths.shape[0], self.nr))
        end = jnp.clip(length + offset[None, :], 0, length)
        blocks = cdiv(end, self.bk)
        if self.pages:
            last_col = jnp.clip(cdiv(end, self.page) - 1, 0, self.maxp - 1)
        else:
            last_col = jnp.zeros_like(end)
        return jnp.stack([length, end, blocks, last_col], axis=-1).astype(I32).reshape(-1)


def _field(sched: Any, geo: Geometry, b: Any, i: Any, name: str) -> Any:
    return sched[(b * geo.nr + i) * NF + _F[name]]


def _visible_block(sched: Any, geo: Geometry, b: Any, i: Any, j: Any) -> Any:
    """Key block ``j`` clamped to the last one tile ``(b, i)`` sees (an invisible step re-uses the resident block)."""
    return jnp.minimum(j, jnp.maximum(_field(sched, geo, b, i, "blocks") - 1, 0))


def _kv_specs(geo: Geometry, d: int) -> list[Any]:
    """Block specs of the latent: one ``[bk, D]`` slice of ``kv[b]`` (dense), or ``ppb`` whole pages (paged)."""
    if not geo.pages:
        return [pl.BlockSpec((None, geo.bk, d), lambda b, i, j, sched: (b, _visible_block(sched, geo, b, i, j), 0))]

    def page_spec(slot: int) -> Any:
        def index(b: Any, i: Any, j: Any, sched: Any, tables: Any) -> Any:
            col = _visible_block(sched, geo, b, i, j) * geo.pages + slot
            col = jnp.minimum(col, _field(sched, geo, b, i, "last_col"))
            return tables[b * geo.maxp + col], 0, 0

        return pl.BlockSpec((None, geo.page, d), index)

    return [page_spec(slot) for slot in range(geo.pages)]


def _read_kv(geo: Geometry, kv_refs: Any, j: Any, end: Any, partial: bool) -> Any:
    """The key block ``[bk, D]``; in a ``partial`` block (one reaching past the tile's key end) the rows
    from the end on are zeroed (selected in float32: packed bfloat16 selects are not on every chip)."""
    kv = kv_refs[0][...] if len(kv_refs) == 1 else jnp.concatenate([r[...] for r in kv_refs], axis=0)
    if partial:
        pos = j * geo.bk + lax.broadcasted_iota(I32, (geo.bk, 1), 0)
        kv = jnp.where(pos < end, kv.astype(F32), 0.0).astype(kv.dtype)
    return kv


def _values(geo: Geometry, kv: Any) -> Any:
    return kv if geo.value_dim == kv.shape[1] else kv[:, : geo.value_dim]


def _scores(geo: Geometry, q: Any, kv: Any, limit: Any, j: Any, length: Any) -> tuple[Any, Any]:
    """``(s, allowed)`` of one ``[bq, bk]`` tile; ``s`` is float32, ``-inf`` where not admitted."""
    s = lax.dot_general(q, kv, (((1,), (1,)), ((), ())), preferred_element_type=F32) * geo.scale
    cols = j * geo.bk + lax.broadcasted_iota(I32, s.shape, 1)
    allowed = cols <= length + limit  # limit [bq, 1]
    return jnp.where(allowed, s, -jnp.inf), allowed


def _when_visible(geo: Geometry, j: Any, end: Any, blocks: Any, step: Any) -> None:
    """Run ``step(partial)`` on a visible key block: ``partial`` (zero the rows past the end) only where needed."""
    visible = j < blocks
    whole = (j + 1) * geo.bk <= end
    pl.when(visible & whole)(lambda: step(False))
    pl.when(visible & jnp.logical_not(whole))(lambda: step(True))


def _split(geo: Geometry, refs: tuple[Any, ...], n_inputs: int) -> tuple[Any, tuple[Any, ...], tuple[Any, ...]]:
    """``(sched, inputs, rest)``: the scalar prefetch (the schedule first), the ``n_inputs`` array inputs
    before the latent, then the latent's refs followed by outputs and scratch."""
    n_prefetch = 2 if geo.pages else 1
    return refs[0], refs[n_prefetch : n_prefetch + n_inputs], refs[n_prefetch + n_inputs :]


def compiler_params(interpret: Any) -> Any:
    if interpret:
        # JAX's TPU interpreter does not extend dimension_semantics by the grid axes that vmap prepends
        # (Mosaic's lowering does), so interpreted kernels leave them unset: every axis sequential.
        return pltpu.CompilerParams()
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))


def _row_spec(geo: Geometry, width: int) -> Any:
    return pl.BlockSpec((None, geo.bq, width), lambda b, i, j, *_: (b, i, 0))


def _limit_spec(geo: Geometry) -> Any:
    return pl.BlockSpec((geo.bq, 1), lambda b, i, j, *_: (i, 0))


def _prefetch(geo: Geometry, sched: jax.Array, tables: jax.Array | None) -> tuple[jax.Array, ...]:
    if geo.pages:
        assert tables is not None, "a paged geometry needs the page table"
        return sched, tables
    return (sched,)


# ----------------------------------------------------------------------------------------- forward


def _fwd_kernel(geo: Geometry, *refs: Any) -> None:
    sched, (limit_ref, q_ref), rest = _split(geo, refs, 2)
    n_kv = max(geo.pages, 1)
    kv_refs, (o_ref, lse_ref, m_sc, l_sc, acc_sc) = rest[:n_kv], rest[n_kv:]
    b, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length, end = _field(sched, geo, b, i, "length"), _field(sched, geo, b, i, "end")

    @pl.when(j == 0)
    def _init() -> None:
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, F32)
        l_sc[...] = jnp.zeros(l_sc.shape, F32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, F32)

    def step(partial: bool) -> None:
        kv = _read_kv(geo, kv_refs, j, end, partial)
        s, allowed = _scores(geo, q_ref[...], kv, limit_ref[...], j, length)
        m_prev = m_sc[:, :1]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row with nothing admitted yet stays at 0
        p = jnp.where(allowed, jnp.exp(s - m_safe), 0.0)
        alpha = jnp.exp(m_prev - m_safe)
        l_sc[...] = jnp.broadcast_to(alpha * l_sc[:, :1] + jnp.sum(p, axis=1, keepdims=True), l_sc.shape)
        v = _values(geo, kv)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=F32)
        acc_sc[...] = alpha * acc_sc[...] + pv
        m_sc[...] = jnp.broadcast_to(m_new, m_sc.shape)

    _when_visible(geo, j, end, _field(sched, geo, b, i, "blocks"), step)

    @pl.when(j == pl.num_programs(2) - 1)
    def _finish() -> None:
        l = l_sc[:, :1]
        has = l > 0  # rows that admitted no key (an empty cache, causal rows before the first key): zeros
        o_ref[...] = jnp.where(has, acc_sc[...] / jnp.where(has, l, 1.0), 0.0).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(has, m_sc[:, :1] + jnp.log(jnp.where(has, l, 1.0)), -jnp.inf)


def forward(
    geo: Geometry, sched: jax.Array, tables: jax.Array | None, q: jax.Array, kv: jax.Array, interpret: Any
) -> tuple[jax.Array, jax.Array]:
    """``(o [B, Rp, E] in q.dtype, lse [B, Rp, 1] float32)`` of the row-major query tile ``q [B, Rp, D]``."""
    b, rp, d = q.shape
    e = geo.value_dim
    return pl.pallas_call(
        functools.partial(_fwd_kernel, geo),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2 if geo.pages else 1,
            grid=(b, geo.nr, geo.nk),
            in_specs=[_limit_spec(geo), _row_spec(geo, d), *_kv_specs(geo, d)],
            out_specs=[_row_spec(geo, e), _row_spec(geo, 1)],
            scratch_shapes=[
                pltpu.VMEM((geo.bq, LANES), F32),  # running max
                pltpu.VMEM((geo.bq, LANES), F32),  # running sum
                pltpu.VMEM((geo.bq, e), F32),  # accumulator
            ],
        ),
        out_shape=[jax.ShapeDtypeStruct((b, rp, e), q.dtype), jax.ShapeDtypeStruct((b, rp, 1), F32)],
        compiler_params=compiler_params(interpret),
        interpret=interpret,
        name="ejkernel_mla_decode_fwd",
    )(*_prefetch(geo, sched, tables), jnp.asarray(geo.row_limits()), q, *([kv] * max(geo.pages, 1)))


# ---------------------------------------------------------------------------------------- backward


def _bwd_kernel(geo: Geometry, *refs: Any) -> None:
    sched, (limit_ref, q_ref, do_ref, lse_ref, delta_ref), rest = _split(geo, refs, 5)
    n_kv = max(geo.pages, 1)
    kv_refs, (dq_ref, dkv_ref, dq_sc) = rest[:n_kv], rest[n_kv:]
    b, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length, end = _field(sched, geo, b, i, "length"), _field(sched, geo, b, i, "end")
    blocks = _field(sched, geo, b, i, "blocks")
    e = geo.value_dim

    @pl.when(j == 0)
    def _init() -> None:
        dq_sc[...] = jnp.zeros(dq_sc.shape, F32)

    def step(partial: bool) -> None:
        kv = _read_kv(geo, kv_refs, j, end, partial)
        q, do = q_ref[...], do_ref[...]
        s, allowed = _scores(geo, q, kv, limit_ref[...], j, length)
        lse = lse_ref[...]
        p = jnp.where(allowed, jnp.exp(s - jnp.where(lse == -jnp.inf, 0.0, lse)), 0.0)
        dp = lax.dot_general(do, _values(geo, kv), (((1,), (1,)), ((), ())), preferred_element_type=F32)
        ds = p * (dp - delta_ref[...])
        dq_sc[...] += lax.dot_general(ds.astype(kv.dtype), kv, (((1,), (0,)), ((), ())), preferred_element_type=F32)
        rows = (((0,), (0,)), ((), ()))  # contract the query rows: dS^T Q, P^T dO
        dkey = lax.dot_general(ds.astype(q.dtype), q, rows, preferred_element_type=F32) * geo.scale
        dval = lax.dot_general(p.astype(do.dtype), do, rows, preferred_element_type=F32)
        if e == dkey.shape[1]:
            dkv_ref[...] = dkey + dval
        else:  # the value role covers the first E (lane-aligned) dims only
            dkv_ref[:, :e] = dkey[:, :e] + dval
            dkv_ref[:, e:] = dkey[:, e:]

    _when_visible(geo, j, end, blocks, step)

    @pl.when(j >= blocks)
    def _unread() -> None:
        dkv_ref[...] = jnp.zeros(dkv_ref.shape, dkv_ref.dtype)

    @pl.when(j == pl.num_programs(2) - 1)
    def _finish() -> None:
        dq_ref[...] = (dq_sc[...] * geo.scale).astype(dq_ref.dtype)


def backward(
    geo: Geometry,
    sched: jax.Array,
    tables: jax.Array | None,
    q: jax.Array,
    kv: jax.Array,
    do: jax.Array,
    lse: jax.Array,
    delta: jax.Array,
    interpret: Any,
) -> tuple[jax.Array, jax.Array]:
    """``(dq [B, Rp, D] in q.dtype, dkv [B, nr, nk, bk, D] float32)``: ``do [B, Rp, E]`` (zero past ``Dl``),
    ``lse``/``delta [B, Rp, 1]``; ``dkv`` holds each query tile's gradient of each key block it read
    (zeros for the blocks it did not), to be summed over tiles and put back in the latent's layout."""
    b, rp, d = q.shape
    return pl.pallas_call(
        functools.partial(_bwd_kernel, geo),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2 if geo.pages else 1,
            grid=(b, geo.nr, geo.nk),
            in_specs=[
                _limit_spec(geo),
                _row_spec(geo, d),
                _row_spec(geo, geo.value_dim),
                _row_spec(geo, 1),
                _row_spec(geo, 1),
                *_kv_specs(geo, d),
            ],
            out_specs=[
                _row_spec(geo, d),
                pl.BlockSpec((None, None, None, geo.bk, d), lambda b, i, j, *_: (b, i, j, 0, 0)),
            ],
            scratch_shapes=[pltpu.VMEM((geo.bq, d), F32)],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((b, rp, d), q.dtype),
            jax.ShapeDtypeStruct((b, geo.nr, geo.nk, geo.bk, d), F32),
        ],
        compiler_params=compiler_params(interpret),
        interpret=interpret,
        name="ejkernel_mla_decode_bwd",
    )(*_prefetch(geo, sched, tables), jnp.asarray(geo.row_limits()), q, do, lse, delta, *([kv] * max(geo.pages, 1)))
