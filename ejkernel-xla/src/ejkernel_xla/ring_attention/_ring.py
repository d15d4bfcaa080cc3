"""Ring attention in plain JAX: blockwise flash attention whose keys/values travel round a mesh axis.

Every device keeps its queries and, at ring step ``r``, holds the key/value shard of device
``src = (me - r) mod n`` (step 0: its own). It attends its queries to that shard with the blockwise
machinery of ``ejkernel_xla.flash_attention._blockwise`` (the same tiles, online softmax and block
skipping; ``_ShardCtx`` only changes which keys a query row admits), merges the shard's partial
``(out, lse)`` into its running result by log-sum-exp, and passes the shard on with ``lax.ppermute``
(device i sends to i + 1; the send overlaps the step's compute where the backend runs collectives
asynchronously, and the n-th send, which brings each shard home, is the one wasted transfer). A shard
pair that causal/window masking leaves empty is skipped whole (``lax.cond``): under a contiguous causal
ring device r computes only r + 1 of the n steps, but the last device still computes all of them and
bounds the time; the zigzag/striped layouts give every device the same work at every step.

Which keys a row admits: positions inside a shard increase with the local index under every layout,
so the keys of a shard that a query row admits under causal/window masking are one interval of
local indices, found by ``searchsorted`` on the shard's global positions. The block ranges of the
blockwise loops (which key blocks a query block sees, which it sees whole) follow from those
intervals exactly as in ``_blockwise`` for a single device.

Backward (``jax.custom_vjp``, residuals: the inputs, ``out`` and ``lse`` only): a second ring. With the
final ``lse`` and ``delta = rowsum(dO * O)`` every shard pair's contribution is independent, so each
step adds the visiting shard's ``dK``/``dV`` into float32 accumulators that travel with that shard's
keys/values; after ``n`` steps each accumulator is back on the device that owns the shard. ``dQ``
accumulates locally. Memory is O(T + S) per device: no ``T x S`` array, no gathered sequence.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ejkernel.kernels.signatures.ring_attention import global_positions, ring_axis_size

from ejkernel_xla.flash_attention._blockwise import F32, NEG_INF, Options, _bmm, _Ctx, _pad_axis


@dataclasses.dataclass(frozen=True)
class RingOptions:
    """Static (hashable) options of one call."""

    scale: float
    causal: bool = False
    window: tuple[int, int] | None = None
    soft_cap: float | None = None
    axis_name: str | None = None
    layout: str = "contiguous"
    fwd_blocks: tuple[int | None, int | None] = (None, None)  # (q, kv); None: default_blocks of the local lengths
    bwd_blocks: tuple[int | None, int | None] = (None, None)

    def blockwise(self) -> Options:
        return Options(
            scale=self.scale,
            causal=self.causal,
            window=self.window,
            soft_cap=self.soft_cap,
            fwd_blocks=self.fwd_blocks,
            bwd_blocks=self.bwd_blocks,
        )


class _ShardCtx(_Ctx):
    """``_Ctx`` for the local queries against one key/value shard: row i admits the local keys ``[lo_i, hi_i)``.

    Without ``bounds`` it is only a layout helper (blocking, unblocking). ``segments``: the segment ids
    already blocked, ``([nq, B, bq], [nk, B, bk])``.
    """

    def __init__(
        self,
        o: Options,
        qkv: tuple[jax.Array, jax.Array, jax.Array],
        blocks: tuple[int | None, int | None],
        kvm: bool,
        bounds: tuple[jax.Array, jax.Array] | None = None,
        segments: tuple[jax.Array, jax.Array] | None = None,
    ) -> None:
        self._bounds = bounds
        super().__init__(o, (*qkv, None, None, None, None, None, None, None), blocks, kvm)
        if segments is not None:
            self.qseg, self.kvseg = segments
            self.data_mask = True

    def segment_blocks(self, qseg: jax.Array, kvseg: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``[B, T]``, ``[B, S]`` -> ``[nq, B, bq]``, ``[nk, B, bk]`` (the ``segments`` of a shard context)."""
        qs = _pad_axis(qseg, 1, self.Tp).reshape(self.B, self.nq, self.bq).transpose(1, 0, 2)
        ks = _pad_axis(kvseg, 1, self.Sp).reshape(self.B, self.nk, self.bk).transpose(1, 0, 2)
        return qs, ks

    def _ranges(self, cuq: Any, cuk: Any) -> None:
        self.struct_mask = False
        if self._bounds is None:
            return
        T, S, Tp, Sp, bq, bk, nq, nk = self.T, self.S, self.Tp, self.Sp, self.bq, self.bk, self.nq, self.nk
        klo, khi = (x.astype(jnp.int32) for x in self._bounds)
        klo, khi = _pad_axis(klo, 0, Tp, Sp), _pad_axis(khi, 0, Tp, 0)  # padding rows see nothing
        empty = klo >= khi
        klo, khi = jnp.where(empty, Sp, klo), jnp.where(empty, 0, khi)
        self.row_lo, self.row_hi = klo.reshape(nq, bq), khi.reshape(nq, bq)
        self.struct_mask = self.o.causal or self.o.window is not None or Sp > S
        # From here as ``_Ctx._ranges``: the hull of the rows' intervals per query block, the blocks
        # every real row sees whole, and the converse tables per key block for the backward.
        i = jnp.arange(Tp, dtype=jnp.int32)
        kv_lo = klo.reshape(nq, bq).min(axis=1) // bk
        kv_hi = -(-khi.reshape(nq, bq).max(axis=1) // bk)
        flo = jnp.clip(-(-jnp.where(i < T, klo, 0).reshape(nq, bq).max(axis=1) // bk), kv_lo, kv_hi)
        fhi = jnp.clip(jnp.where(i < T, khi, Sp).reshape(nq, bq).min(axis=1) // bk, flo, kv_hi)
        self.kv_lo, self.kv_hi, self.kv_flo, self.kv_fhi = (x.astype(jnp.int32) for x in (kv_lo, kv_hi, flo, fhi))
        kb = jnp.arange(nk, dtype=jnp.int32)[None, :]
        seen = (self.kv_lo[:, None] <= kb) & (kb < self.kv_hi[:, None])
        any_ = seen.any(axis=0)
        self.q_lo = jnp.where(any_, jnp.argmax(seen, axis=0), 0).astype(jnp.int32)
        self.q_hi = jnp.where(any_, nq - jnp.argmax(seen[::-1], axis=0), 0).astype(jnp.int32)
        full = (self.kv_flo[:, None] <= kb) & (kb < self.kv_fhi[:, None])
        any_full = full.any(axis=0)
        qf = jnp.where(any_full, jnp.argmax(full, axis=0), 0).astype(jnp.int32)
        qfh = jnp.where(any_full, nq - jnp.argmax(full[::-1], axis=0), 0).astype(jnp.int32)
        contiguous = full.sum(axis=0) == qfh - qf
        qf = jnp.clip(jnp.where(contiguous, qf, self.q_hi), self.q_lo, self.q_hi)
        self.q_flo, self.q_fhi = qf, jnp.clip(jnp.where(contiguous, qfh, qf), qf, self.q_hi)

    def block_mask(self, qi: Any, kj: Any, structural: bool) -> jax.Array | None:
        allowed = None
        if structural and self.struct_mask:
            j = self.cols(kj * self.bk + jnp.arange(self.bk, dtype=jnp.int32))
            allowed = (j >= self.rows(self.row_lo[qi])) & (j < self.rows(self.row_hi[qi]))
        if self.qseg is not None and self.kvseg is not None:
            same = self.rows(self.qseg[qi]) == self.cols(self.kvseg[kj])
            allowed = same if allowed is None else allowed & same
        return allowed


def _ring_info(o: RingOptions) -> tuple[int, jax.Array]:
    """``(n, me)``: the ring's size and this device's place on it (``(1, 0)`` without an axis)."""
    n = ring_axis_size(o.axis_name)
    me = lax.axis_index(o.axis_name) if o.axis_name is not None else jnp.int32(0)
    return n, jnp.asarray(me, jnp.int32)


def _row_bounds(o: RingOptions, n: int, me: jax.Array, src: jax.Array, t: int, s: int) -> tuple[jax.Array, jax.Array]:
    """Per local query row, the local keys ``[lo, hi)`` of shard ``src`` that causal/window masking admits."""
    lo, hi = jnp.zeros((t,), jnp.int32), jnp.full((t,), s, jnp.int32)
    if not (o.causal or o.window is not None):
        return lo, hi
    kpos = global_positions(o.layout, n, src, s, jnp)  # increasing: the admitted keys are an interval
    diag = global_positions(o.layout, n, me, t, jnp) + n * (s - t)  # bottom-right aligned diagonal
    last = diag  # causal
    if o.window is not None:
        left, right = (min(w, n * (t + s)) for w in o.window)  # wider is unbounded; keeps int32 exact
        lo = jnp.searchsorted(kpos, diag - left, side="left").astype(jnp.int32)
        if not o.causal:  # with causal the diagonal bounds the window's right side (right >= 0)
            last = diag + right
    hi = jnp.searchsorted(kpos, last, side="right").astype(jnp.int32)
    return lo, hi


def _rotate(x: Any, o: RingOptions, n: int) -> Any:
    """Pass ``x`` (a pytree) to the next device of the ring."""
    if n == 1:
        return x
    return lax.ppermute(x, o.axis_name, [(i, (i + 1) % n) for i in range(n)])


def _merge(out: jax.Array, lse: jax.Array, out_r: jax.Array, lse_r: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Two normalised partial results over disjoint keys -> the result over both (float32)."""
    new = jnp.logaddexp(lse, lse_r)
    ref = jnp.where(jnp.isfinite(new), new, 0.0)  # no key on either side: both weights are exp(-inf) = 0
    a, b = jnp.exp(lse - ref), jnp.exp(lse_r - ref)
    return out * a[..., None] + out_r * b[..., None], new


# ---- forward --------------------------------------------------------------------------------------


def forward(o: RingOptions, q: jax.Array, k: jax.Array, v: jax.Array, qseg: Any, kvseg: Any) -> tuple[Any, Any]:
    """``(out [B, T, H, Dv] in query.dtype, lse [B, H, T] float32)`` of this device's queries."""
    bo = o.blockwise()
    n, me = _ring_info(o)
    c = _ShardCtx(bo, (q, k, v), bo.fwd_blocks, kvm=False)
    B, K, G, bq, bk, Dv, T, S = c.B, c.K, c.G, c.bq, c.bk, c.Dv, c.T, c.S
    qb = c.scaled_q_blocks(q)  # [nq, B, K, G, bq, D]
    segs = None if qseg is None else c.segment_blocks(qseg, kvseg)

    def shard(src: jax.Array, ktb: jax.Array, vb: jax.Array, kvsb: Any) -> tuple[jax.Array, jax.Array]:
        """Partial (out, lse) of our queries over shard ``src``: float32, in block layout."""
        lo, hi = _row_bounds(o, n, me, src, T, S)
        sc = _ShardCtx(bo, (q, k, v), bo.fwd_blocks, False, (lo, hi), None if segs is None else (segs[0], kvsb))

        def per_q(_: Any, x: Any) -> Any:
            qi, qblk = x

            def step(kj: Any, carry: Any, masked: bool) -> Any:
                s, _, allowed = sc.scores(qi, kj, qblk, ktb[kj], masked)

                def update(carry: Any) -> Any:
                    m, l, acc = carry
                    m_new = jnp.maximum(m, s.max(axis=-1))
                    m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)  # nothing seen yet: p = 0 below
                    p = jnp.exp(s - m_safe[..., None])
                    alpha = jnp.exp(m - m_safe)
                    pv = _bmm(p.astype(v.dtype), vb[kj], (B * K, G * bq, bk), (B * K, bk, Dv), (B, K, G, bq, Dv))
                    return m_new, alpha * l + p.sum(axis=-1), acc * alpha[..., None] + pv

                return sc.skip_if_masked(allowed, update, carry)

            rows = (B, K, G, bq)
            init = (jnp.full(rows, NEG_INF, F32), jnp.zeros(rows, F32), jnp.zeros((*rows, Dv), F32))
            m, l, acc = sc.loop(sc.kv_lo[qi], sc.kv_hi[qi], sc.kv_flo[qi], sc.kv_fhi[qi], step, init)
            seen = l > 0
            out = acc / jnp.where(seen, l, 1.0)[..., None]
            return None, (out, jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), NEG_INF))

        def attend(_: Any) -> tuple[jax.Array, jax.Array]:
            return lax.scan(per_q, None, (jnp.arange(c.nq, dtype=jnp.int32), qb))[1]

        def nothing(_: Any) -> tuple[jax.Array, jax.Array]:
            return jnp.zeros((c.nq, B, K, G, bq, Dv), F32), jnp.full((c.nq, B, K, G, bq), NEG_INF, F32)

        return lax.cond(jnp.any(lo < hi), attend, nothing, None)

    def ring_step(r: Any, carry: Any) -> Any:
        out, lse, ktb, vb, kvsb = carry
        out_r, lse_r = shard((me - r) % n, ktb, vb, kvsb)
        out, lse = _merge(out, lse, out_r, lse_r)
        ktb, vb, kvsb = _rotate((ktb, vb, kvsb), o, n)
        return out, lse, ktb, vb, kvsb

    kv = (c.kv_blocks(k, transposed=True), c.kv_blocks(v), None if segs is None else segs[1])
    if n == 1:
        out, lse = shard(me, *kv)
    else:
        init = (jnp.zeros((c.nq, B, K, G, bq, Dv), F32), jnp.full((c.nq, B, K, G, bq), NEG_INF, F32), *kv)
        out, lse = lax.fori_loop(0, n, ring_step, init)[:2]
    return c.q_unblock(out).astype(q.dtype), c.rows_unblock(lse)


# ---- backward -------------------------------------------------------------------------------------


def backward(o: RingOptions, res: tuple[Any, ...], dout: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(dq, dk, dv)`` of this device's shards, by a second ring in which dK/dV travel with their K/V."""
    q, k, v, qseg, kvseg, out, lse = res
    bo = o.blockwise()
    n, me = _ring_info(o)
    c = _ShardCtx(bo, (q, k, v), bo.bwd_blocks, kvm=True)
    B, K, G, bq, bk, D, Dv, T, S = c.B, c.K, c.G, c.bq, c.bk, c.D, c.Dv, c.T, c.S
    BK, GQ = B * K, G * bq
    dout = dout.astype(q.dtype)
    qb, dob = c.scaled_q_blocks(q), c.q_blocks(dout)  # [nq, B, K, G, bq, E]
    qtb, dotb = c.t_blocks(qb), c.t_blocks(dob)  # [nq, B, K, E, G, bq]
    delta = c.rows_blocks(jnp.einsum("bthd,bthd->bht", dout.astype(F32), out.astype(F32)))  # [nq, B, K, G, bq]
    lse = c.rows_blocks(jnp.where(jnp.isfinite(lse), lse, 0.0))  # rows without keys: P = 0 anyway
    segs = None if qseg is None else c.segment_blocks(qseg, kvseg)

    def shard(src: jax.Array, dq: jax.Array, kb: jax.Array, vb: jax.Array, kvsb: Any, dkb: jax.Array,
              dvb: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:  # fmt: skip
        """Add shard ``src``'s part to ``dq`` and its ``dk``/``dv`` to the accumulators ``dkb``/``dvb``."""
        lo, hi = _row_bounds(o, n, me, src, T, S)
        sc = _ShardCtx(bo, (q, k, v), bo.bwd_blocks, True, (lo, hi), None if segs is None else (segs[0], kvsb))

        def per_k(dq: Any, x: Any) -> Any:
            kj, kblk, vblk, dk, dv = x

            def step(qi: Any, carry: Any, masked: bool) -> Any:
                s, t, allowed = sc.scores(qi, kj, kblk, qtb[qi], masked)

                def update(carry: Any) -> Any:
                    dq, dk, dv = carry
                    p = jnp.exp(s - sc.row_stat(lse[qi]))  # [B, K, bk, G, bq]
                    dp = _bmm(vblk, dotb[qi], (BK, bk, Dv), (BK, Dv, GQ), (B, K, bk, G, bq))
                    dv = dv + _bmm(p.astype(dout.dtype), dob[qi], (BK, bk, GQ), (BK, GQ, Dv), (B, K, bk, Dv))
                    ds = p * (dp - sc.row_stat(delta[qi]))
                    if t is not None:
                        ds = ds * (1.0 - t * t)
                    if not c.prescale:  # else q is scaled already, and dq is scaled once at the end
                        ds = ds * F32(o.scale)
                    dq_blk = _bmm(ds.astype(k.dtype), kblk, (BK, bk, GQ), (BK, bk, D), (B, K, G, bq, D), True)
                    dk = dk + _bmm(ds.astype(q.dtype), qb[qi], (BK, bk, GQ), (BK, GQ, D), (B, K, bk, D))
                    return dq.at[qi].add(dq_blk), dk, dv

                return sc.skip_if_masked(allowed, update, carry)

            dq, dk, dv = sc.loop(sc.q_lo[kj], sc.q_hi[kj], sc.q_flo[kj], sc.q_fhi[kj], step, (dq, dk, dv))
            return dq, (dk, dv)

        def attend(operand: Any) -> Any:
            dq, dkb, dvb = operand
            dq, (dkb, dvb) = lax.scan(per_k, dq, (jnp.arange(c.nk, dtype=jnp.int32), kb, vb, dkb, dvb))
            return dq, dkb, dvb

        return lax.cond(jnp.any(lo < hi), attend, lambda operand: operand, (dq, dkb, dvb))

    def ring_step(r: Any, carry: Any) -> Any:
        dq, kb, vb, kvsb, dkb, dvb = carry
        dq, dkb, dvb = shard((me - r) % n, dq, kb, vb, kvsb, dkb, dvb)
        # After the n-th pass every shard, with its dK/dV, is back on the device that owns it.
        kb, vb, kvsb, dkb, dvb = _rotate((kb, vb, kvsb, dkb, dvb), o, n)
        return dq, kb, vb, kvsb, dkb, dvb

    dq = jnp.zeros((c.nq, B, K, G, bq, D), F32)
    dkb, dvb = jnp.zeros((c.nk, B, K, bk, D), F32), jnp.zeros((c.nk, B, K, bk, Dv), F32)
    kv = (c.kv_blocks(k), c.kv_blocks(v), None if segs is None else segs[1])
    if n == 1:
        dq, dkb, dvb = shard(me, dq, *kv, dkb, dvb)
    else:
        dq, *_, dkb, dvb = lax.fori_loop(0, n, ring_step, (dq, *kv, dkb, dvb))
    if c.prescale:
        dq = dq * F32(o.scale)
    return c.q_unblock(dq).astype(q.dtype), c.kv_unblock(dkb).astype(k.dtype), c.kv_unblock(dvb).astype(v.dtype)


# ---- custom_vjp -----------------------------------------------------------------------------------


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def ring_attention(o: RingOptions, q, k, v, qseg, kvseg):  # noqa: ANN001, ANN201
    """Ring attention; differentiable in ``q``, ``k`` and ``v`` (segment ids get no cotangent)."""
    return forward(o, *_arrays((q, k, v, qseg, kvseg)))[0]


def _arrays(arrays: tuple[Any, ...]) -> tuple[Any, ...]:
    """NumPy inputs (``jax.test_util.check_grads`` passes them) as JAX arrays, so tracers can index them."""
    return tuple(None if x is None else jnp.asarray(x) for x in arrays)


def _ring_fwd(o: RingOptions, *primals: Any) -> tuple[jax.Array, Any]:
    arrays = _arrays(primals)
    out, lse = forward(o, *arrays)
    return out, (*arrays, out, lse)


def _ring_bwd(o: RingOptions, res: Any, g: Any) -> tuple[Any, ...]:
    dq, dk, dv = backward(o, res, jnp.asarray(g))
    return (dq, dk, dv, None, None)


ring_attention.defvjp(_ring_fwd, _ring_bwd)
