"""Blockwise MLA in plain JAX: O(T) memory forward and backward over a dense or a paged latent.

Every head attends one shared latent per key (``[D]``: key; its first ``Dl`` dims: value). A key
block is ``[B, bk, D]`` read in place, never repeated over heads and never the whole sequence:

- dense ``kv [B, S, D]``: a ``dynamic_slice`` at ``min(kj * bk, S - bk)`` (the last block overlaps
  its predecessor rather than padding the keys, which would copy them; keys already seen are masked);
- paged ``kv [P, page, D]``: ``ppb`` table entries per block (``bk = ppb * page``), gathered.

Forward (FlashAttention-2): a ``lax.scan`` over query blocks of ``bq`` rows; for each, a
``lax.fori_loop`` over the key blocks that some row of the block can see (up to the longest
sequence, or the causal diagonal of its last row: blocks past it are skipped), with an online
softmax in float32. Scores are ``[B, H, bq, bk]``: all heads are rows of one matmul against the
latent block. It returns the output and the log-sum-exp (``-inf`` on rows without keys).

Backward: ``jax.custom_vjp`` keeps ``(inputs, out, lse)``, never the probabilities. It walks the
same blocks query-major (paged keys may be shared between batches and sit anywhere in the cache),
recomputes ``P = exp(s - lse)`` tile by tile, accumulates the block's ``dQ`` in a carry and adds
``dKV = scale * dS^T Q + [P^T dO, 0]`` (key role plus value role of the latent) into a float32
gradient of ``kv`` at the keys read: a slice update when dense, a scatter-add at the pages when paged.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ejkernel.device import cdiv

F32 = jnp.float32
NEG_INF = -jnp.inf


def balance(block: int, n: int) -> int:
    """The block size used for length ``n``: at most ``block``, as even as the same number of blocks
    allows (a multiple of 8), so that little is computed twice or padded (n=300, block=256: 152)."""
    block = max(1, int(block))
    if n <= block:
        return max(1, n)
    return min(block, cdiv(cdiv(n, cdiv(n, block)), 8) * 8)


@dataclasses.dataclass(frozen=True)
class Options:
    """Static options of one call; blocks are ``(q rows, kv keys)`` (paged: rounded down to whole pages)."""

    latent_dim: int
    scale: float
    causal: bool
    fwd_blocks: tuple[int, int]
    bwd_blocks: tuple[int, int]


class _Geometry:
    """One pass's view of a call: block sizes, how to read a key block, the key blocks each query block visits."""

    def __init__(self, o: Options, q: jax.Array, kv: jax.Array, tables: Any, lens: Any,
                 blocks: tuple[int, int]) -> None:  # fmt: skip
        self.o = o
        self.B, self.T, self.H, self.D = q.shape
        self.Dl = o.latent_dim
        self.bq = balance(blocks[0], self.T)
        self.nq = cdiv(self.T, self.bq)
        self.Tp = self.nq * self.bq
        self.paged = tables is not None
        if self.paged:
            self.page = kv.shape[1]
            maxp = tables.shape[1]
            self.ppb = max(1, min(maxp, blocks[1] // self.page))  # pages per key block
            self.bk = self.ppb * self.page
            self.nk = cdiv(maxp, self.ppb)
            self.lens = jnp.clip(jnp.asarray(lens).astype(jnp.int32), 0, maxp * self.page)
            # Entries past the pages in use may hold anything: read page 0 there (masked out anyway).
            p = jnp.arange(self.nk * self.ppb, dtype=jnp.int32)[None, :]
            t = jnp.pad(jnp.asarray(tables).astype(jnp.int32), ((0, 0), (0, self.nk * self.ppb - maxp)))
            t = jnp.where(p < cdiv(self.lens, self.page)[:, None], jnp.clip(t, 0, kv.shape[0] - 1), 0)
            self.tables = t.reshape(self.B, self.nk, self.ppb)
            length = self.lens
        else:
            self.S = kv.shape[1]
            self.bk = balance(blocks[1], self.S)
            self.nk = cdiv(self.S, self.bk)
            length = jnp.full((self.B,), self.S, jnp.int32)
        # Row i of batch b sees keys [0, L_b), with causal [0, i + L_b - T]. A query block visits the
        # key blocks that any of its rows sees in any batch.
        last_row = jnp.minimum((jnp.arange(self.nq, dtype=jnp.int32) + 1) * self.bq, self.T) - 1
        hi = jnp.broadcast_to(length[None, :], (self.nq, self.B))
        if o.causal:
            hi = jnp.minimum(hi, last_row[:, None] + length[None, :] - self.T + 1)
        self.n_blocks = cdiv(jnp.maximum(hi, 0).max(axis=1), self.bk)  # [nq]
        # Dense blocks need a mask only for causality or where the last block overlaps the one before.
        self.masked = self.paged or o.causal or self.S % self.bk != 0

    # ---- loops: one block is taken without a loop (a loop's bounds and carry cost on accelerators) ----------

    def scan(self, f: Any, carry: Any, xs: Any) -> Any:
        """``lax.scan(f, carry, xs)`` over the query blocks."""
        if self.nq > 1:
            return lax.scan(f, carry, xs)
        carry, y = f(carry, jax.tree.map(lambda x: x[0], xs))
        return carry, jax.tree.map(lambda x: x[None], y)

    def loop(self, step: Any, carry: Any, qi: Any) -> Any:
        """``step`` over the key blocks query block ``qi`` visits. One key block is taken whether or not a row
        sees it (its scores are masked then, so nothing is added)."""
        if self.nk > 1:
            return lax.fori_loop(0, self.n_blocks[qi], step, carry)
        return step(jnp.int32(0), carry)

    # ---- layout -------------------------------------------------------------------------------

    def q_blocks(self, x: jax.Array) -> jax.Array:
        """``[B, T, H, E]`` -> ``[nq, B, H, bq, E]``."""
        x = jnp.pad(x, ((0, 0), (0, self.Tp - self.T), (0, 0), (0, 0)))
        return x.reshape(self.B, self.nq, self.bq, self.H, x.shape[-1]).transpose(1, 0, 3, 2, 4)

    def q_unblock(self, x: jax.Array) -> jax.Array:
        """``[nq, B, H, bq, E]`` -> ``[B, T, H, E]``."""
        return x.transpose(1, 0, 3, 2, 4).reshape(self.B, self.Tp, self.H, x.shape[-1])[:, : self.T]

    def rows_blocks(self, x: jax.Array) -> jax.Array:
        """``[B, H, T]`` -> ``[nq, B, H, bq]``."""
        x = jnp.pad(x, ((0, 0), (0, 0), (0, self.Tp - self.T)))
        return x.reshape(self.B, self.H, self.nq, self.bq).transpose(2, 0, 1, 3)

    def rows_unblock(self, x: jax.Array) -> jax.Array:
        """``[nq, B, H, bq]`` -> ``[B, H, T]``."""
        return x.transpose(1, 2, 0, 3).reshape(self.B, self.H, self.Tp)[:, :, : self.T]

    # ---- key blocks ---------------------------------------------------------------------------

    def where(self, kj: Any) -> Any:
        """Where key block ``kj`` lives: its first key (dense) or its pages ``[B, ppb]`` (paged)."""
        if self.paged:
            return lax.dynamic_index_in_dim(self.tables, kj, axis=1, keepdims=False)
        return jnp.minimum(kj * self.bk, self.S - self.bk)

    def read(self, kv: jax.Array, at: Any) -> jax.Array:
        """The latents of a key block, ``[B, bk, D]``."""
        if self.paged:
            return kv[at].reshape(self.B, self.bk, self.D)
        return lax.dynamic_slice_in_dim(kv, at, self.bk, axis=1)

    def add(self, dkv: jax.Array, at: Any, x: jax.Array) -> jax.Array:
        """``dkv`` (shaped as ``kv``) plus ``x [B, bk, D]`` at the keys of a block."""
        if self.paged:
            return dkv.at[at.reshape(-1)].add(x.reshape(self.B * self.ppb, self.page, self.D))
        return lax.dynamic_update_slice_in_dim(dkv, lax.dynamic_slice_in_dim(dkv, at, self.bk, 1) + x, at, 1)

    def scores(self, qi: Any, kj: Any, at: Any, qblk: jax.Array, kvb: jax.Array) -> jax.Array:
        """Float32 ``scale * q . kv`` of a tile ``[B, H, bq, bk]``, ``-inf`` where not admitted."""
        s = jnp.einsum("bhqd,bkd->bhqk", qblk, kvb, preferred_element_type=F32) * F32(self.o.scale)
        if not self.masked:
            return s
        k = jnp.arange(self.bk, dtype=jnp.int32)[None, None, None, :]
        if self.paged:
            j = kj * self.bk + k
            length: Any = self.lens[:, None, None, None]
            allowed = j < length
        else:
            j = at + k
            length = self.S
            allowed = j >= kj * self.bk  # an overlapping last block: the keys before are counted already
        if self.o.causal:
            i = qi * self.bq + jnp.arange(self.bq, dtype=jnp.int32)[None, None, :, None]
            allowed &= j <= i + length - self.T
        return jnp.where(allowed, s, NEG_INF)


def forward(o: Options, q: jax.Array, kv: jax.Array, tables: Any = None,
            lens: Any = None) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """``(out [B, T, H, Dl] in q.dtype, lse [B, H, T] float32)``."""
    g = _Geometry(o, q, kv, tables, lens, o.fwd_blocks)
    B, H, bq, Dl = g.B, g.H, g.bq, g.Dl

    def per_q(_: Any, x: Any) -> Any:
        qi, qblk = x

        def step(kj: Any, carry: Any) -> Any:
            m, l, acc = carry
            at = g.where(kj)
            kvb = g.read(kv, at)
            s = g.scores(qi, kj, at, qblk, kvb)
            m_new = jnp.maximum(m, s.max(axis=-1))
            m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)  # nothing seen yet: p = 0 below
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            pv = jnp.einsum("bhqk,bkl->bhql", p.astype(q.dtype), kvb[..., :Dl], preferred_element_type=F32)
            return m_new, alpha * l + p.sum(axis=-1), acc * alpha[..., None] + pv

        init = (jnp.full((B, H, bq), NEG_INF, F32), jnp.zeros((B, H, bq), F32), jnp.zeros((B, H, bq, Dl), F32))
        m, l, acc = g.loop(step, init, qi)
        seen = l > 0
        out = acc / jnp.where(seen, l, 1.0)[..., None]
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), NEG_INF)
        return None, (out.astype(q.dtype), lse)

    _, (out, lse) = g.scan(per_q, None, (jnp.arange(g.nq, dtype=jnp.int32), g.q_blocks(q)))
    return g.q_unblock(out), g.rows_unblock(lse)


def backward(o: Options, q: jax.Array, kv: jax.Array, tables: Any, lens: Any, out: jax.Array, lse: jax.Array,
             dout: jax.Array) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """``(dq, dkv)``; a paged ``dkv`` is zero at the cache slots no batch reads."""
    g = _Geometry(o, q, kv, tables, lens, o.bwd_blocks)
    B, H, bq, D, Dl = g.B, g.H, g.bq, g.D, g.Dl
    dout = dout.astype(q.dtype)
    delta = jnp.einsum("bthl,bthl->bht", dout.astype(F32), out.astype(F32))
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)  # rows without keys: P = 0 anyway
    scale = F32(o.scale)
    xs = (jnp.arange(g.nq, dtype=jnp.int32), g.q_blocks(q), g.q_blocks(dout), g.rows_blocks(lse), g.rows_blocks(delta))

    def per_q(dkv: Any, x: Any) -> Any:
        qi, qblk, doblk, lse_blk, delta_blk = x

        def step(kj: Any, carry: Any) -> Any:
            dq, dkv = carry
            at = g.where(kj)
            kvb = g.read(kv, at)
            p = jnp.exp(g.scores(qi, kj, at, qblk, kvb) - lse_blk[..., None])  # [B, H, bq, bk]
            dp = jnp.einsum("bhql,bkl->bhqk", doblk, kvb[..., :Dl], preferred_element_type=F32)
            ds = (p * (dp - delta_blk[..., None])).astype(q.dtype)
            dq = dq + jnp.einsum("bhqk,bkd->bhqd", ds, kvb, preferred_element_type=F32)
            dkvb = jnp.einsum("bhqk,bhqd->bkd", ds, qblk, preferred_element_type=F32) * scale
            dv = jnp.einsum("bhqk,bhql->bkl", p.astype(q.dtype), doblk, preferred_element_type=F32)
            dkvb = dkvb.at[..., :Dl].add(dv)  # the value is the latent's first Dl dims
            return dq, g.add(dkv, at, dkvb)

        dq, dkv = g.loop(step, (jnp.zeros((B, H, bq, D), F32), dkv), qi)
        return dkv, dq * scale

    dkv, dq = g.scan(per_q, jnp.zeros(kv.shape, F32), xs)
    return g.q_unblock(dq).astype(q.dtype), dkv.astype(kv.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention(o: Options, q, kv, tables, lens):  # noqa: ANN001, ANN201
    """Blockwise MLA (paged when ``tables`` is given); differentiable in ``q`` and ``kv`` only."""
    return forward(o, *_arrays(q, kv, tables, lens))[0]


def _arrays(*arrays: Any) -> tuple[Any, ...]:
    """NumPy inputs (``jax.test_util.check_grads`` passes them) as JAX arrays, so tracers can index them."""
    return tuple(None if x is None else jnp.asarray(x) for x in arrays)


def _attention_fwd(o: Options, q: Any, kv: Any, tables: Any, lens: Any) -> tuple[jax.Array, Any]:
    q, kv, tables, lens = _arrays(q, kv, tables, lens)
    out, lse = forward(o, q, kv, tables, lens)
    return out, (q, kv, tables, lens, out, lse)


def _attention_bwd(o: Options, res: Any, dout: Any) -> tuple[Any, ...]:
    q, kv, tables, lens, out, lse = res
    dq, dkv = backward(o, q, kv, tables, lens, out, lse, jnp.asarray(dout))
    return dq, dkv, None, None


attention.defvjp(_attention_fwd, _attention_bwd)
