"""The attention-block contract in plain XLA (``ejkernel.modules.operations.flash_attention_block``).

The blockwise machinery of ``_blockwise`` (tiles, online softmax, block skipping), with ``_IntervalCtx``
changing only which keys a row admits: the interval ``[lo_i, hi_i)`` of keys that causal/window masking
admits on the block's positions (``key_intervals``; the positions are non-decreasing, so the admitted keys
are one interval). The block ranges of the loops (which key blocks a query block sees, which it sees whole)
follow from those intervals as in ``_blockwise`` for one sequence.

Forward: ``(out, lse)`` in float32, ``out`` left unnormalised by nothing but the block's own softmax (rows
without keys: zeros and ``-inf``). Backward: one pass over key blocks with the given (global) ``lse`` and
``delta = rowsum(dO * O) - dlse``; ``dq``/``dk``/``dv`` come back in float32 so that a schedule can sum them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ejkernel.kernels.signatures._attention import key_intervals, normalize_window
from ejkernel.ops.utils.datacarrier import BwdParams, FwdParams

from ejkernel_xla.flash_attention._blockwise import F32, NEG_INF, Options, _bmm, _Ctx
from ejkernel_xla.flash_attention.interface import candidate_cfgs as _flash_candidates
from ejkernel_xla.flash_attention.interface import heuristic_cfg as _flash_heuristic


class _IntervalCtx(_Ctx):
    """``_Ctx`` whose row ``i`` admits the keys ``[lo_i, hi_i)`` (``bounds``; None: every key), and segment ids."""

    def __init__(
        self,
        o: Options,
        arrays: tuple[Any, Any, Any, Any, Any],
        blocks: tuple[int | None, int | None],
        kvm: bool,
        bounds: tuple[jax.Array, jax.Array] | None,
    ) -> None:
        self._bounds = bounds
        q, k, v, qseg, kvseg = arrays
        super().__init__(o, (q, k, v, None, None, qseg, kvseg, None, None, None, None, None), blocks, kvm)

    def _ranges(self, cuq: Any, cuk: Any, kvlen: Any, prefix: Any) -> None:
        if self._bounds is None:
            klo, khi = jnp.zeros((1, self.T), jnp.int32), jnp.full((1, self.T), self.S, jnp.int32)
        else:
            klo, khi = (x.astype(jnp.int32)[None] for x in self._bounds)
        self.set_ranges(klo, khi, self._bounds is not None)

    def kv_source(self, x: jax.Array, transposed: bool = False) -> tuple[bool, jax.Array]:
        """What :meth:`kv_tile` reads: ``x`` itself when its length needs no padding (each tile is then sliced and
        laid out when used: a schedule calls a block per step, and a blocked copy of every visiting shard
        would cost O(S) memory per step), else its blocks (``kv_blocks``)."""
        if self.Sp == self.S:
            return True, x
        return False, self.kv_blocks(x, transposed)

    def kv_tile(self, src: tuple[bool, jax.Array], kj: Any, transposed: bool = False) -> jax.Array:
        """Key block ``kj`` of a :meth:`kv_source`: ``[B, K, bk, E]`` (``transposed``: ``[B, K, E, bk]``)."""
        sliced, x = src
        if not sliced:
            return x[kj]
        tile = lax.dynamic_slice_in_dim(x, kj * self.bk, self.bk, axis=1)  # [B, bk, K, E]
        return tile.transpose(0, 2, 3, 1) if transposed else tile.transpose(0, 2, 1, 3)


def _setup(
    query: Any, key: Any, q_positions: Any, kv_positions: Any, softmax_scale: Any, causal: bool, sliding_window: Any,
    logits_soft_cap: Any, params: Any,
) -> tuple[Options, tuple[jax.Array, jax.Array] | None]:  # fmt: skip
    window = normalize_window(sliding_window)
    blocks = (None, None) if params is None else (params.q_blocksize, params.kv_blocksize)
    opts = Options(
        scale=float(query.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale),
        causal=bool(causal),
        window=window,
        soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        fwd_blocks=blocks,
        bwd_blocks=blocks,
    )
    bounds = None
    if causal or window is not None:
        t, s = query.shape[1], key.shape[1]
        bounds = key_intervals(q_positions, kv_positions, t, s, causal=bool(causal), window=window)
    return opts, bounds


def _arrays(*xs: Any) -> tuple[Any, ...]:
    return tuple(None if x is None else jnp.asarray(x) for x in xs)


def flash_attention_block(
    query, key, value, *, q_positions=None, kv_positions=None, q_segment_ids=None, kv_segment_ids=None,
    softmax_scale=None, causal=False, sliding_window=None, logits_soft_cap=None, fwd_params=None, bwd_params=None,
):  # fmt: skip
    """``(out, lse)``, both float32: the contract's forward. ``fwd_params``: ``q_blocksize``/``kv_blocksize``."""
    q, k, v, qseg, kvseg = _arrays(query, key, value, q_segment_ids, kv_segment_ids)
    o, bounds = _setup(q, k, q_positions, kv_positions, softmax_scale, causal, sliding_window, logits_soft_cap,
                       fwd_params)  # fmt: skip
    c = _IntervalCtx(o, (q, k, v, qseg, kvseg), o.fwd_blocks, False, bounds)
    B, K, G, bq, bk, Dv = c.B, c.K, c.G, c.bq, c.bk, c.Dv
    qb, ktb, vb = c.scaled_q_blocks(q), c.kv_source(k, transposed=True), c.kv_source(v)

    def per_q(_: Any, x: Any) -> Any:
        qi, qblk = x

        def step(kj: Any, carry: Any, masked: bool) -> Any:
            s, _, allowed = c.scores(qi, kj, qblk, c.kv_tile(ktb, kj, transposed=True), masked)

            def update(carry: Any) -> Any:
                m, l, acc = carry
                m_new = jnp.maximum(m, s.max(axis=-1))
                m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)  # nothing seen yet: p = 0 below
                p = jnp.exp(s - m_safe[..., None])
                alpha = jnp.exp(m - m_safe)
                pv = _bmm(p.astype(v.dtype), c.kv_tile(vb, kj), (B * K, G * bq, bk), (B * K, bk, Dv), (B, K, G, bq, Dv))
                return m_new, alpha * l + p.sum(axis=-1), acc * alpha[..., None] + pv

            return c.skip_if_masked(allowed, update, carry)

        rows = (B, K, G, bq)
        init = (jnp.full(rows, NEG_INF, F32), jnp.zeros(rows, F32), jnp.zeros((*rows, Dv), F32))
        m, l, acc = c.loop(c.kv_lo[qi], c.kv_hi[qi], c.kv_flo[qi], c.kv_fhi[qi], step, init)
        seen = l > 0
        out = acc / jnp.where(seen, l, 1.0)[..., None]
        return None, (out, jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), NEG_INF))

    _, (out, lse) = lax.scan(per_q, None, (jnp.arange(c.nq, dtype=jnp.int32), qb))
    return c.q_unblock(out), c.rows_unblock(lse)


def flash_attention_block_bwd(
    query, key, value, out, lse, dout, *, dlse=None, q_positions=None, kv_positions=None, q_segment_ids=None,
    kv_segment_ids=None, softmax_scale=None, causal=False, sliding_window=None, logits_soft_cap=None,
    fwd_params=None, bwd_params=None,
):  # fmt: skip
    """``(dq, dk, dv)``, float32: the contract's backward. ``fwd_params`` (this op's one stage, ``BwdParams``):
    ``q_blocksize``/``kv_blocksize`` of the backward's tiles."""
    q, k, v, qseg, kvseg, out, lse, dout, dlse = _arrays(
        query, key, value, q_segment_ids, kv_segment_ids, out, lse, dout, dlse
    )
    o, bounds = _setup(q, k, q_positions, kv_positions, softmax_scale, causal, sliding_window, logits_soft_cap,
                       fwd_params)  # fmt: skip
    c = _IntervalCtx(o, (q, k, v, qseg, kvseg), o.bwd_blocks, True, bounds)
    B, K, G, bq, bk, D, Dv = c.B, c.K, c.G, c.bq, c.bk, c.D, c.Dv
    BK, GQ = B * K, G * bq
    dout = dout.astype(q.dtype)
    qb, dob = c.scaled_q_blocks(q), c.q_blocks(dout)  # [nq, B, K, G, bq, E]
    qtb, dotb = c.t_blocks(qb), c.t_blocks(dob)  # [nq, B, K, E, G, bq]
    kb, vb = c.kv_source(k), c.kv_source(v)
    delta = jnp.einsum("bthd,bthd->bht", dout.astype(F32), out.astype(F32))
    if dlse is not None:
        delta = delta - dlse.astype(F32)
    delta = c.rows_blocks(delta)  # [nq, B, K, G, bq]
    lse = c.rows_blocks(jnp.where(jnp.isfinite(lse), lse, 0.0).astype(F32))  # rows without keys: P = 0 anyway

    def per_k(dq: Any, kj: Any) -> Any:
        kblk, vblk = c.kv_tile(kb, kj), c.kv_tile(vb, kj)  # [B, K, bk, E]

        def step(qi: Any, carry: Any, masked: bool) -> Any:
            s, t, allowed = c.scores(qi, kj, kblk, qtb[qi], masked)

            def update(carry: Any) -> Any:
                dq, dk, dv = carry
                p = jnp.exp(s - c.row_stat(lse[qi]))  # [B, K, bk, G, bq]
                dp = _bmm(vblk, dotb[qi], (BK, bk, Dv), (BK, Dv, GQ), (B, K, bk, G, bq))
                dv = dv + _bmm(p.astype(dout.dtype), dob[qi], (BK, bk, GQ), (BK, GQ, Dv), (B, K, bk, Dv))
                ds = p * (dp - c.row_stat(delta[qi]))
                if t is not None:
                    ds = ds * (1.0 - t * t)
                if not c.prescale:  # else q is scaled already, and dq is scaled once at the end
                    ds = ds * F32(o.scale)
                dq_blk = _bmm(ds.astype(k.dtype), kblk, (BK, bk, GQ), (BK, bk, D), (B, K, G, bq, D), True)
                dk = dk + _bmm(ds.astype(q.dtype), qb[qi], (BK, bk, GQ), (BK, GQ, D), (B, K, bk, D))
                return dq.at[qi].add(dq_blk), dk, dv

            return c.skip_if_masked(allowed, update, carry)

        init = (dq, jnp.zeros((B, K, bk, D), F32), jnp.zeros((B, K, bk, Dv), F32))
        dq, dk, dv = c.loop(c.q_lo[kj], c.q_hi[kj], c.q_flo[kj], c.q_fhi[kj], step, init)
        return dq, (dk, dv)

    dq0 = jnp.zeros((c.nq, B, K, G, bq, D), F32)
    dq, (dk, dv) = lax.scan(per_k, dq0, jnp.arange(c.nk, dtype=jnp.int32))
    if c.prescale:
        dq = dq * F32(o.scale)
    return c.q_unblock(dq), c.kv_unblock(dk), c.kv_unblock(dv)


# ---- launch parameters: flash attention's (tiles of one block pair) -----------------------------------


def heuristic_cfg(inv: Any, stage: str) -> FwdParams | BwdParams | None:
    """The forward's tiles (``FwdParams``), as ``flash_attention``'s heuristic on the block's lengths."""
    return _flash_heuristic(inv, stage)


def candidate_cfgs(inv: Any, stage: str) -> list[FwdParams | BwdParams]:
    return _flash_candidates(inv, stage)


def bwd_heuristic_cfg(inv: Any, stage: str) -> BwdParams | None:
    """The backward op's one stage takes the backward's tiles (``BwdParams``); it has no backward of its own."""
    return _flash_heuristic(inv, "bwd") if stage == "fwd" else None  # type: ignore[return-value]


def bwd_candidate_cfgs(inv: Any, stage: str) -> list[BwdParams]:
    return _flash_candidates(inv, "bwd") if stage == "fwd" else []  # type: ignore[return-value]


__all__ = [
    "bwd_candidate_cfgs",
    "bwd_heuristic_cfg",
    "candidate_cfgs",
    "flash_attention_block",
    "flash_attention_block_bwd",
    "heuristic_cfg",
]
