"""Blockwise flash attention in plain JAX: O(T) memory forward and backward.

Layout. Heads are split into ``K`` kv heads times ``G = H // K`` query heads per group, so GQA/MQA
needs no repeat of keys/values: queries are held as ``[nq, B, K, G, bq, D]`` blocks, keys/values as
``[nk, B, K, bk, D]`` blocks (``T``/``S`` padded up to block multiples; padded keys are masked).

Forward (FlashAttention-2): a ``lax.scan`` over query blocks; for each, ``lax.fori_loop``s over
the key blocks it can see (a dynamic range from causal / sliding window / packing / lengths, so blocks that
are fully masked cost nothing; blocks seen whole skip the mask arithmetic), with an online softmax
in float32 (running max ``m``, running sum ``l``, accumulator). It returns the output and the
log-sum-exp ``lse`` (``-inf`` on rows without any admitted key).

Backward: ``jax.custom_vjp`` keeps ``(inputs, out, lse)``, never the probabilities. A ``lax.scan``
over key blocks recomputes ``P = exp(s - lse)`` tile by tile over the query blocks that see the
key block, accumulates that block's ``dK``/``dV`` (summed over the heads of each group), adds into a
float32 ``dQ`` carry and writes the ``dBias`` tile, with ``delta = rowsum(dO * O)``. Nothing of size
``T x S`` is materialised, except ``dBias`` when a bias is differentiated (it has the bias's size)
and, in the backward, a transposed copy of a given bias/mask (so that its tiles read contiguously).

Tiles: query-major ``[B, K, G, bq, bk]`` in the forward, key-major ``[B, K, bk, G, bq]`` in the
backward (there ``dV = P^T dO`` and ``dK = dS^T Q`` are plain matmuls of the tile). Matmuls take
3-D operands (batch ``B*K``), which keeps XLA:CPU from inserting layout copies of tiles.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ejkernel.device import cdiv
from ejkernel.kernels.signatures._attention import dropout_keep, mask_intervals

F32 = jnp.float32
NEG_INF = -jnp.inf

# Default blocks, measured on a 2-core CPU (B=1, H=8, D=64, float32): (256, 512) for both passes
# (128..1024 were all within ~10%). The score tile (B * H * bq * bk floats) is then 4 MiB; with more
# batch x heads the blocks shrink to keep it there (B=4, H=16, T=2048: 128 x 128 was fastest).
DEFAULT_BLOCKS = (256, 512)
TILE_ELEMENTS = 1 << 20
MIN_BLOCK = 64


def _balance(block: int, n: int) -> int:
    """The block size used for length ``n``: at most ``block``, as even as the same number of blocks
    allows (a multiple of 8), so that padding stays small (n=300, block=256: 152, not 256)."""
    block = max(1, int(block))
    if n <= block:
        return max(1, n)
    return min(block, cdiv(cdiv(n, cdiv(n, block)), 8) * 8)


def default_blocks(b: int, h: int, t: int, s: int) -> tuple[int, int]:
    """Heuristic ``(q_blocksize, kv_blocksize)`` for ``B=b, H=h, T=t, S=s`` (both passes)."""
    bq, bk = DEFAULT_BLOCKS
    while b * h * bq * bk > TILE_ELEMENTS and max(bq, bk) > MIN_BLOCK:
        if bk >= bq:
            bk //= 2
        else:
            bq //= 2
    return _balance(bq, t), _balance(bk, s)


@dataclasses.dataclass(frozen=True)
class Options:
    """Static (hashable) options of one call."""

    scale: float
    causal: bool = False
    window: tuple[int, int] | None = None
    soft_cap: float | None = None
    dropout_prob: float = 0.0
    static_seed: int | None = None  # a Python-int seed; an array seed travels with the arrays
    fwd_blocks: tuple[int | None, int | None] = (None, None)  # (q, kv); None: default_blocks
    bwd_blocks: tuple[int | None, int | None] = (None, None)


def _pad_axis(x: jax.Array, axis: int, size: int, value: Any = 0) -> jax.Array:
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _bmm(a: jax.Array, b: jax.Array, a3: tuple[int, ...], b3: tuple[int, ...], out: tuple[int, ...],
         transpose_a: bool = False) -> jax.Array:  # fmt: skip
    """Float32 batched matmul of ``a`` and ``b`` viewed as 3-D ``(batch, rows, cols)``, reshaped to ``out``."""
    spec = "xkm,xkn->xmn" if transpose_a else "xmk,xkn->xmn"
    return jnp.einsum(spec, a.reshape(a3), b.reshape(b3), preferred_element_type=F32).reshape(out)


def _hull(table: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per column of a boolean ``[n, m]`` table: ``[first, last + 1)`` of its True rows (``[0, 0)`` if none)."""
    n = table.shape[0]
    any_ = table.any(axis=0)
    first = jnp.argmax(table, axis=0).astype(jnp.int32)
    last = (n - jnp.argmax(table[::-1], axis=0)).astype(jnp.int32)
    return jnp.where(any_, first, 0), jnp.where(any_, last, 0)


class _Ctx:
    """One pass's view of a call: block sizes, side inputs in tile layout, row/column info, block ranges.

    ``kvm``: tiles are key-major (the backward) rather than query-major (the forward).
    """

    def __init__(self, o: Options, arrays: tuple[Any, ...], blocks: tuple[int | None, int | None], kvm: bool) -> None:
        q, k, v, bias, mask, qseg, kvseg, seed, cuq, cuk, kvlen, prefix = arrays
        self.o, self.kvm = o, kvm
        self.B, self.T, self.H, self.D = q.shape
        self.S, self.K = k.shape[1], k.shape[2]
        self.Dv = v.shape[-1]
        self.G = self.H // self.K
        dq, dk = default_blocks(self.B, self.H, self.T, self.S)
        self.bq, self.bk = _balance(blocks[0] or dq, self.T), _balance(blocks[1] or dk, self.S)
        self.nq, self.nk = cdiv(self.T, self.bq), cdiv(self.S, self.bk)
        self.Tp, self.Sp = self.nq * self.bq, self.nk * self.bk
        self.seed = o.static_seed if seed is None else seed
        self.dropout = o.dropout_prob > 0
        if self.dropout and self.seed is None:
            raise ValueError("flash_attention: dropout_prob > 0 needs dropout_seed")
        # Scale the queries once rather than every tile where that is exact enough.
        self.prescale = q.dtype == F32 or math.frexp(o.scale)[0] == 0.5
        self.bias = None if bias is None else self._side(bias, 0)
        self.mask = None if mask is None else self._side(mask, False)
        self.qseg: jax.Array | None = None
        self.kvseg: jax.Array | None = None
        if qseg is not None:
            self.qseg = _pad_axis(qseg, 1, self.Tp).reshape(self.B, self.nq, self.bq).transpose(1, 0, 2)
            self.kvseg = _pad_axis(kvseg, 1, self.Sp).reshape(self.B, self.nk, self.bk).transpose(1, 0, 2)
        self.data_mask = mask is not None or qseg is not None
        self._ranges(cuq, cuk, kvlen, prefix)

    # ---- layout -------------------------------------------------------------------------------

    def _side(self, x: jax.Array, pad: Any) -> jax.Array:
        """A bias/mask ``[#B, #H, T, S]`` -> padded, ``[#B, K|1, G|1, Tp, Sp]`` or key-major ``[#B, K|1, Sp, G|1, Tp]``."""
        x = x[:, :, None] if x.shape[1] == 1 else x.reshape(x.shape[0], self.K, self.G, *x.shape[2:])
        x = _pad_axis(_pad_axis(x, 3, self.Tp, pad), 4, self.Sp, pad)
        return x.transpose(0, 1, 4, 2, 3) if self.kvm else x

    def side_tile(self, x: jax.Array, qi: Any, kj: Any) -> jax.Array:
        """The tile of a ``_side`` array at query block ``qi`` and key block ``kj``."""
        i0, j0 = qi * self.bq, kj * self.bk
        if self.kvm:
            return lax.dynamic_slice(x, (0, 0, j0, 0, i0), (x.shape[0], x.shape[1], self.bk, x.shape[3], self.bq))
        return lax.dynamic_slice(x, (0, 0, 0, i0, j0), (*x.shape[:3], self.bq, self.bk))

    def q_blocks(self, x: jax.Array) -> jax.Array:
        """``[B, T, H, E]`` -> ``[nq, B, K, G, bq, E]``."""
        e = x.shape[-1]
        x = _pad_axis(x, 1, self.Tp).reshape(self.B, self.nq, self.bq, self.K, self.G, e)
        return x.transpose(1, 0, 3, 4, 2, 5)

    def scaled_q_blocks(self, q: jax.Array) -> jax.Array:
        """``q_blocks`` of the queries, times the softmax scale where that is exact enough."""
        if self.prescale:
            q = (q.astype(F32) * F32(self.o.scale)).astype(q.dtype)
        return self.q_blocks(q)

    def q_unblock(self, x: jax.Array) -> jax.Array:
        """``[nq, B, K, G, bq, E]`` -> ``[B, T, H, E]``."""
        e = x.shape[-1]
        return x.transpose(1, 0, 4, 2, 3, 5).reshape(self.B, self.Tp, self.H, e)[:, : self.T]

    @staticmethod
    def t_blocks(x: jax.Array) -> jax.Array:
        """``[nq, B, K, G, bq, E]`` -> ``[nq, B, K, E, G, bq]``."""
        return x.transpose(0, 1, 2, 5, 3, 4)

    def kv_blocks(self, x: jax.Array, transposed: bool = False) -> jax.Array:
        """``[B, S, K, E]`` -> ``[nk, B, K, bk, E]`` (``transposed``: ``[nk, B, K, E, bk]``)."""
        e = x.shape[-1]
        x = _pad_axis(x, 1, self.Sp).reshape(self.B, self.nk, self.bk, self.K, e)
        return x.transpose(1, 0, 3, 4, 2) if transposed else x.transpose(1, 0, 3, 2, 4)

    def kv_unblock(self, x: jax.Array) -> jax.Array:
        """``[nk, B, K, bk, E]`` -> ``[B, S, K, E]``."""
        e = x.shape[-1]
        return x.transpose(1, 0, 3, 2, 4).reshape(self.B, self.Sp, self.K, e)[:, : self.S]

    def rows_blocks(self, x: jax.Array) -> jax.Array:
        """``[B, H, T]`` -> ``[nq, B, K, G, bq]``."""
        x = _pad_axis(x, 2, self.Tp).reshape(self.B, self.K, self.G, self.nq, self.bq)
        return x.transpose(3, 0, 1, 2, 4)

    def rows_unblock(self, x: jax.Array) -> jax.Array:
        """``[nq, B, K, G, bq]`` -> ``[B, H, T]``."""
        return x.transpose(1, 2, 3, 0, 4).reshape(self.B, self.H, self.Tp)[:, :, : self.T]

    # ---- which keys each query row may see ----------------------------------------------------

    def _ranges(self, cuq: Any, cuk: Any, kvlen: Any, prefix: Any) -> None:
        o = self.o
        row_lo, row_hi, _, _ = mask_intervals(
            self.T,
            self.S,
            causal=o.causal,
            sliding_window=o.window,
            cu_seqlens_q=cuq,
            cu_seqlens_k=cuk,
            kv_lengths=kvlen,
            prefix_lengths=prefix,
        )
        structural = cuq is not None or o.causal or o.window is not None or kvlen is not None or prefix is not None
        self.set_ranges(row_lo, row_hi, structural)

    def set_ranges(self, klo: jax.Array, khi: jax.Array, structural: bool) -> None:
        """Row ``i`` of sequence ``b`` sees the keys ``[klo[b, i], khi[b, i])`` (``[B|1, T]`` each); from them the
        block ranges of both loops. ``structural``: the intervals exclude keys (else only padding is masked)."""
        T, S, Tp, Sp, bq, bk, nq, nk = self.T, self.S, self.Tp, self.Sp, self.bq, self.bk, self.nq, self.nk
        nb = klo.shape[0]
        klo, khi = _pad_axis(klo, 1, Tp, Sp), _pad_axis(khi, 1, Tp, 0)  # padding rows see nothing
        empty = klo >= khi
        klo, khi = jnp.where(empty, Sp, klo), jnp.where(empty, 0, khi)  # the empty range is [Sp, 0)
        self.row_lo = klo.reshape(nb, nq, bq).transpose(1, 0, 2)  # [nq, B|1, bq]
        self.row_hi = khi.reshape(nb, nq, bq).transpose(1, 0, 2)
        self.struct_mask = structural or Sp > S
        # Key blocks [kv_lo, kv_hi) of every query block: the hull of what its rows see (in any sequence); of
        # those, [kv_flo, kv_fhi) are seen whole by every row (rows past T are padding: they do not count).
        i = jnp.arange(Tp, dtype=jnp.int32)
        kv_lo = self.row_lo.min(axis=(1, 2)) // bk
        kv_hi = cdiv(self.row_hi.max(axis=(1, 2)), bk)
        flo = jnp.clip(cdiv(jnp.where(i < T, klo, 0).reshape(nb, nq, bq).max(axis=(0, 2)), bk), kv_lo, kv_hi)
        fhi = jnp.clip(jnp.where(i < T, khi, Sp).reshape(nb, nq, bq).min(axis=(0, 2)) // bk, flo, kv_hi)
        self.kv_lo, self.kv_hi, self.kv_flo, self.kv_fhi = (x.astype(jnp.int32) for x in (kv_lo, kv_hi, flo, fhi))
        # Query blocks [q_lo, q_hi) of every key block: the hull of those that see it, and the run
        # [q_flo, q_fhi) of those that see it whole (left empty unless they are contiguous).
        kb = jnp.arange(nk, dtype=jnp.int32)[None, :]
        self.q_lo, self.q_hi = _hull((self.kv_lo[:, None] <= kb) & (kb < self.kv_hi[:, None]))
        full = (self.kv_flo[:, None] <= kb) & (kb < self.kv_fhi[:, None])
        qf, qfh = _hull(full)
        contiguous = full.sum(axis=0) == qfh - qf
        qf = jnp.clip(jnp.where(contiguous, qf, self.q_hi), self.q_lo, self.q_hi)
        self.q_flo, self.q_fhi = qf, jnp.clip(jnp.where(contiguous, qfh, qf), qf, self.q_hi)

    def loop(self, lo: Any, hi: Any, flo: Any, fhi: Any, step: Any, carry: Any) -> Any:
        """``carry = step(j, carry, masked)`` for the blocks ``j`` in ``[lo, hi)``; masked outside ``[flo, fhi)``."""
        if not self.struct_mask:
            return lax.fori_loop(lo, hi, lambda j, c: step(j, c, False), carry)
        before = flo - lo

        def edge(t: Any, c: Any) -> Any:
            return step(jnp.where(t < before, lo + t, fhi + (t - before)), c, True)

        carry = lax.fori_loop(0, before + (hi - fhi), edge, carry)
        return lax.fori_loop(flo, fhi, lambda j, c: step(j, c, False), carry)

    # ---- one tile -----------------------------------------------------------------------------

    def rows(self, x: jax.Array) -> jax.Array:
        """``[bq]`` or ``[B, bq]`` -> broadcastable along the rows of a tile."""
        lead = x.shape[:-1] if x.ndim == 2 else (1,)
        return x.reshape(*lead, 1, 1, 1, x.shape[-1]) if self.kvm else x.reshape(*lead, 1, 1, x.shape[-1], 1)

    def cols(self, x: jax.Array) -> jax.Array:
        """``[bk]`` or ``[B, bk]`` -> broadcastable along the columns of a tile."""
        lead = x.shape[:-1] if x.ndim == 2 else (1,)
        return x.reshape(*lead, 1, x.shape[-1], 1, 1) if self.kvm else x.reshape(*lead, 1, 1, 1, x.shape[-1])

    def row_stat(self, x: jax.Array) -> jax.Array:
        """``[B, K, G, bq]`` (a per-row statistic) -> broadcastable to a tile."""
        return x[:, :, None] if self.kvm else x[..., None]

    def block_mask(self, qi: Any, kj: Any, structural: bool) -> jax.Array | None:
        """What query block ``qi`` may see of key block ``kj``, broadcastable to a tile (None: all).

        ``structural``: apply the rows' key intervals (causal/window/packing/lengths/padding; False for blocks
        seen whole).
        """
        allowed = None

        def conj(a: Any, b: Any) -> Any:
            return b if a is None else a & b

        if structural and self.struct_mask:
            j = self.cols(kj * self.bk + jnp.arange(self.bk, dtype=jnp.int32))
            allowed = (j >= self.rows(self.row_lo[qi])) & (j < self.rows(self.row_hi[qi]))
        if self.mask is not None:
            allowed = conj(allowed, self.side_tile(self.mask, qi, kj))
        if self.qseg is not None and self.kvseg is not None:
            allowed = conj(allowed, self.rows(self.qseg[qi]) == self.cols(self.kvseg[kj]))
        return allowed

    def scores(self, qi: Any, kj: Any, lhs: jax.Array, rhs: jax.Array, structural: bool) -> tuple[jax.Array, Any, Any]:
        """Float32 scores of a tile (``-inf`` where not admitted), ``tanh`` of the soft cap, the mask.

        Query-major: ``lhs`` a block of ``scaled_q_blocks``, ``rhs`` of transposed ``kv_blocks``;
        key-major: ``lhs`` a block of ``kv_blocks``, ``rhs`` the ``t_blocks`` of ``scaled_q_blocks``.
        """
        o, B, K, G, bq, bk, D = self.o, self.B, self.K, self.G, self.bq, self.bk, self.D
        if self.kvm:
            s = _bmm(lhs, rhs, (B * K, bk, D), (B * K, D, G * bq), (B, K, bk, G, bq))
        else:
            s = _bmm(lhs, rhs, (B * K, G * bq, D), (B * K, D, bk), (B, K, G, bq, bk))
        if not self.prescale:
            s = s * F32(o.scale)
        if self.bias is not None:
            s = s + self.side_tile(self.bias, qi, kj).astype(F32)
        t = None
        if o.soft_cap is not None:
            t = jnp.tanh(s / F32(o.soft_cap))
            s = F32(o.soft_cap) * t
        allowed = self.block_mask(qi, kj, structural)
        if allowed is not None:
            s = jnp.where(allowed, s, NEG_INF)
        return s, t, allowed

    def keep(self, qi: Any, kj: Any) -> jax.Array:
        """Dropout survivors of a tile: exactly the contract's ``dropout_keep``."""
        b = jnp.arange(self.B, dtype=jnp.int32).reshape(-1, 1, 1, 1, 1)
        h = jnp.arange(self.H, dtype=jnp.int32)
        h = h.reshape(1, self.K, 1, self.G, 1) if self.kvm else h.reshape(1, self.K, self.G, 1, 1)
        i = self.rows(qi * self.bq + jnp.arange(self.bq, dtype=jnp.int32))
        j = self.cols(kj * self.bk + jnp.arange(self.bk, dtype=jnp.int32))
        return dropout_keep(self.seed, b, h, i, j, self.H, self.o.dropout_prob, xp=jnp)

    def skip_if_masked(self, allowed: Any, fn: Any, operand: Any) -> Any:
        """``fn(operand)``, skipped when a data-dependent mask (attention_mask, segment ids) admits nothing."""
        if not self.data_mask:
            return fn(operand)
        return lax.cond(jnp.any(allowed), fn, lambda x: x, operand)


# ---- forward --------------------------------------------------------------------------------------


def forward(o: Options, arrays: tuple[Any, ...]) -> tuple[jax.Array, jax.Array]:
    """``(out [B, T, H, Dv] in query.dtype, lse [B, H, T] float32)``."""
    q, k, v = arrays[:3]
    c = _Ctx(o, arrays, o.fwd_blocks, kvm=False)
    B, K, G, bq, bk, Dv = c.B, c.K, c.G, c.bq, c.bk, c.Dv
    qb, ktb, vb = c.scaled_q_blocks(q), c.kv_blocks(k, transposed=True), c.kv_blocks(v)
    inv_keep = F32(1.0 / (1.0 - o.dropout_prob))

    def per_q(_: Any, x: Any) -> Any:
        qi, qblk = x

        def step(kj: Any, carry: Any, masked: bool) -> Any:
            s, _, allowed = c.scores(qi, kj, qblk, ktb[kj], masked)

            def update(carry: Any) -> Any:
                m, l, acc = carry
                m_new = jnp.maximum(m, s.max(axis=-1))
                m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)  # nothing seen yet: p = 0 below
                p = jnp.exp(s - m_safe[..., None])
                alpha = jnp.exp(m - m_safe)
                l = alpha * l + p.sum(axis=-1)
                if c.dropout:
                    p = jnp.where(c.keep(qi, kj), p * inv_keep, 0.0)
                pv = _bmm(p.astype(v.dtype), vb[kj], (B * K, G * bq, bk), (B * K, bk, Dv), (B, K, G, bq, Dv))
                return m_new, l, acc * alpha[..., None] + pv

            return c.skip_if_masked(allowed, update, carry)

        init = (jnp.full((B, K, G, bq), NEG_INF, F32), jnp.zeros((B, K, G, bq), F32), jnp.zeros((B, K, G, bq, Dv), F32))
        m, l, acc = c.loop(c.kv_lo[qi], c.kv_hi[qi], c.kv_flo[qi], c.kv_fhi[qi], step, init)
        seen = l > 0
        out = acc / jnp.where(seen, l, 1.0)[..., None]
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), NEG_INF)
        return None, (out.astype(q.dtype), lse)

    _, (out, lse) = lax.scan(per_q, None, (jnp.arange(c.nq, dtype=jnp.int32), qb))
    return c.q_unblock(out), c.rows_unblock(lse)


# ---- backward -------------------------------------------------------------------------------------


def backward(o: Options, arrays: tuple[Any, ...], out: jax.Array, lse: jax.Array, dout: jax.Array,
             want_dbias: bool = True) -> tuple[Any, ...]:  # fmt: skip
    """``(dq, dk, dv, dbias)``; ``dbias`` is None without a bias or when not ``want_dbias``."""
    q, k, v, bias = arrays[:4]
    c = _Ctx(o, arrays, o.bwd_blocks, kvm=True)
    B, K, G, bq, bk, D, Dv = c.B, c.K, c.G, c.bq, c.bk, c.D, c.Dv
    BK, GQ = B * K, G * bq
    dout = dout.astype(q.dtype)
    qb, dob = c.scaled_q_blocks(q), c.q_blocks(dout)  # [nq, B, K, G, bq, E]
    qtb, dotb = c.t_blocks(qb), c.t_blocks(dob)  # [nq, B, K, E, G, bq]
    kb, vb = c.kv_blocks(k), c.kv_blocks(v)  # [nk, B, K, bk, E]
    delta = c.rows_blocks(jnp.einsum("bthd,bthd->bht", dout.astype(F32), out.astype(F32)))  # [nq, B, K, G, bq]
    lse = c.rows_blocks(jnp.where(jnp.isfinite(lse), lse, 0.0))  # rows without keys: P = 0 anyway
    inv_keep = F32(1.0 / (1.0 - o.dropout_prob))
    scale = F32(o.scale)
    dbias0 = jnp.zeros(c.bias.shape, F32) if c.bias is not None and want_dbias else None

    def per_k(carry: Any, x: Any) -> Any:
        dq, dbias = carry
        kj, kblk, vblk = x

        def step(qi: Any, carry: Any, masked: bool) -> Any:
            s, t, allowed = c.scores(qi, kj, kblk, qtb[qi], masked)

            def update(carry: Any) -> Any:
                dq, dbias, dk, dv = carry
                p = jnp.exp(s - c.row_stat(lse[qi]))
                dpd = _bmm(vblk, dotb[qi], (BK, bk, Dv), (BK, Dv, GQ), (B, K, bk, G, bq))
                if c.dropout:
                    keep = c.keep(qi, kj)
                    pd = jnp.where(keep, p * inv_keep, 0.0)
                    dp = jnp.where(keep, dpd * inv_keep, 0.0)
                else:
                    pd, dp = p, dpd
                dv = dv + _bmm(pd.astype(dout.dtype), dob[qi], (BK, bk, GQ), (BK, GQ, Dv), (B, K, bk, Dv))
                ds = p * (dp - c.row_stat(delta[qi]))
                if t is not None:
                    ds = ds * (1.0 - t * t)
                if dbias is not None:  # each tile is visited once: write, no accumulation
                    axes = tuple(a for a in (0, 1, 3) if dbias.shape[a] == 1 and ds.shape[a] != 1)
                    db = ds.sum(axis=axes, keepdims=True) if axes else ds
                    dbias = lax.dynamic_update_slice(dbias, db, (0, 0, kj * bk, 0, qi * bq))
                if not c.prescale:  # else q is scaled already, and dq is scaled once at the end
                    ds = ds * scale
                dq_blk = _bmm(ds.astype(k.dtype), kblk, (BK, bk, GQ), (BK, bk, D), (B, K, G, bq, D), transpose_a=True)
                dq = dq.at[qi].add(dq_blk)
                dk = dk + _bmm(ds.astype(q.dtype), qb[qi], (BK, bk, GQ), (BK, GQ, D), (B, K, bk, D))
                return dq, dbias, dk, dv

            return c.skip_if_masked(allowed, update, carry)

        init = (dq, dbias, jnp.zeros((B, K, bk, D), F32), jnp.zeros((B, K, bk, Dv), F32))
        dq, dbias, dk, dv = c.loop(c.q_lo[kj], c.q_hi[kj], c.q_flo[kj], c.q_fhi[kj], step, init)
        return (dq, dbias), (dk.astype(k.dtype), dv.astype(v.dtype))

    dq0 = jnp.zeros((c.nq, B, K, G, bq, D), F32)
    (dq, dbias), (dk, dv) = lax.scan(per_k, (dq0, dbias0), (jnp.arange(c.nk, dtype=jnp.int32), kb, vb))
    if c.prescale:
        dq = dq * scale
    dq = c.q_unblock(dq).astype(q.dtype)
    dk, dv = c.kv_unblock(dk), c.kv_unblock(dv)
    if dbias is not None:  # [#B, K|1, Sp, G|1, Tp] -> [#B, #H, T, S]
        dbias = dbias.transpose(0, 1, 3, 4, 2)[:, :, :, : c.T, : c.S].reshape(bias.shape).astype(bias.dtype)
    return dq, dk, dv, dbias


# ---- custom_vjp -----------------------------------------------------------------------------------


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention(o: Options, q, k, v, bias, mask, qseg, kvseg, seed, cuq, cuk, kvlen, prefix):  # noqa: ANN001, ANN201
    """Blockwise attention; differentiable in ``q``, ``k``, ``v`` and ``bias`` (the rest get zero cotangents)."""
    return forward(o, _arrays((q, k, v, bias, mask, qseg, kvseg, seed, cuq, cuk, kvlen, prefix)))[0]


def _arrays(arrays: tuple[Any, ...]) -> tuple[Any, ...]:
    """NumPy inputs (``jax.test_util.check_grads`` passes them) as JAX arrays, so tracers can index them."""
    return tuple(None if x is None else jnp.asarray(x) for x in arrays)


def _attention_fwd(o: Options, *primals: Any) -> tuple[jax.Array, Any]:
    # No symbolic_zeros (which would tell whether the bias is differentiated): shard_map does not
    # support it, and ejkernel runs ops under shard_map. A given bias always gets its dBias.
    arrays = _arrays(primals)
    out, lse = forward(o, arrays)
    return out, (arrays, out, lse)


def _attention_bwd(o: Options, res: Any, g: Any) -> tuple[Any, ...]:
    arrays, out, lse = res
    dq, dk, dv, dbias = backward(o, arrays, out, lse, jnp.asarray(g), arrays[3] is not None)
    return (dq, dk, dv, dbias, *(None,) * 8)


attention.defvjp(_attention_fwd, _attention_bwd)
