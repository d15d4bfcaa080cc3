"""Attention over a sparse list of key tiles per query tile, in plain JAX: O(T) memory forward and backward.

Layout (as ``flash_attention/_blockwise``). Heads are ``K`` kv heads times ``G = H // K`` query heads per
group; queries are tiles ``[nqt, B, K, G, tq, D]``, keys/values tiles ``[nkt, B, K, tk, E]`` (``T``/``S``
padded up to tile multiples; padded keys are masked).

Plan. Which key tiles a query tile needs comes from two sources:

- the structure, static: row ``i`` sees keys ``klo(i) <= j < khi(i)``: all, or when causal the keys
  whose last position ``(j + 1) * key_stride - 1`` is at most ``i + offset`` (``key_stride`` > 1 for
  mean-pooled keys), within a sliding window when one is given; padded rows see nothing;
- the data, possibly traced: a block mask ``[#B, #H, NQ, NK]`` at granularity ``(q_block, kv_block)``
  (tiles are multiples of it), and segment ids (a tile pair whose id ranges do not overlap is dropped).

A tile pair is *admitted* if both sources admit part of it, *full* if both admit all of it (every
valid row sees every key, the mask's sub-blocks are all True, no segment ids). For every "lane" (the
mask's batch x head broadcast, plus the batch when segment ids are given) and query tile, the
admitted tiles are listed twice, sorted into a padded index list: the partial ones and the full ones.
The loops then visit exactly those tiles (a ``lax.fori_loop`` with a data-dependent trip count, the
longest list over lanes), masking tokens only in partial tiles; full tiles skip the mask arithmetic
(lanes beyond the list's end are masked as a whole). Nothing of size ``T x S`` is materialised.

Forward: ``lax.scan`` over query tiles, online softmax in float32 (running max, sum, accumulator), output
and log-sum-exp ``lse`` (``-inf`` on rows without an admitted key). Backward: ``jax.custom_vjp`` keeps
``(inputs, out, lse)``; a second ``lax.scan`` over query tiles recomputes ``P = exp(s - lse)`` on the same
lists, writes that tile's ``dQ`` and scatter-adds ``dK``/``dV`` into float32 carries (in place).

With lanes (a mask per batch or per head), each lane gathers its own key tile: keys are ``[B, K, Gl, tk, D]``
with ``Gl = G`` for a per-head mask, else 1, and the matmuls batch over ``B * K * Gl``.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ejkernel.device import cdiv

from ejkernel_xla.flash_attention._blockwise import _balance, default_blocks

F32 = jnp.float32
NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True)
class Options:
    """Static (hashable) options of one call."""

    scale: float
    soft_cap: float | None = None
    causal: bool = False
    offset: int = 0  # query row i sits at key position i + offset (bottom-right alignment: S - T)
    key_stride: int = 1  # key j covers positions [j * key_stride, (j + 1) * key_stride)
    window: tuple[int, int] | None = None  # (left, right): keys i + offset - left <= j <= i + offset + right
    q_block: int = 1  # granularity of the block mask; tiles are multiples of it
    kv_block: int = 1
    fwd_tiles: tuple[int | None, int | None] = (None, None)  # (q, kv) in tokens; None: default_tiles
    bwd_tiles: tuple[int | None, int | None] = (None, None)
    out_f32: bool = False  # return the output in float32 (for callers that combine outputs)


def _fit(requested: int, unit: int, n: int) -> int:
    """A tile for length ``n``: a multiple of ``unit`` near ``requested``, as even as its count allows."""
    if unit == 1:
        return _balance(requested, n)
    units = cdiv(n, unit)
    r = min(max(1, requested // unit), units)
    return cdiv(units, cdiv(units, r)) * unit


def default_tiles(b: int, h: int, t: int, s: int, q_block: int, kv_block: int, masked: bool) -> tuple[int, int]:
    """Heuristic ``(tq, tk)``: flash attention's blocks without a mask; with one, the mask's blocks (at least 64)."""
    if not masked:
        return default_blocks(b, h, t, s)
    return _fit(max(64, q_block), q_block, t), _fit(max(64, kv_block), kv_block, s)


def _pad_axis(x: jax.Array, axis: int, size: int, value: Any = 0) -> jax.Array:
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _lists(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``[..., n]`` booleans -> (indices of the True entries first, in order; how many)."""
    idx = jnp.argsort(jnp.logical_not(x).astype(jnp.int8), axis=-1, stable=True).astype(jnp.int32)
    return idx, x.sum(axis=-1, dtype=jnp.int32)


class _Plan:
    """One pass's tiles, layouts and key-tile lists (see the module docstring)."""

    def __init__(self, o: Options, q: jax.Array, k: jax.Array, v: jax.Array, mask: Any, qseg: Any, kvseg: Any,
                 tiles: tuple[int | None, int | None]) -> None:  # fmt: skip
        self.o = o
        self.B, self.T, self.H, self.D = q.shape
        self.S, self.K = k.shape[1], k.shape[2]
        self.Dv = v.shape[-1]
        self.G = self.H // self.K
        dq, dk = default_tiles(self.B, self.H, self.T, self.S, o.q_block, o.kv_block, mask is not None)
        self.tq = _fit(tiles[0] or dq, o.q_block, self.T)
        self.tk = _fit(tiles[1] or dk, o.kv_block, self.S)
        self.nqt, self.nkt = cdiv(self.T, self.tq), cdiv(self.S, self.tk)
        self.Tp, self.Sp = self.nqt * self.tq, self.nkt * self.tk
        self.prescale = q.dtype == F32 or math.frexp(o.scale)[0] == 0.5
        self._structure()
        self._lanes(mask, qseg, kvseg)

    def _structure(self) -> None:
        o, T, S, tq, tk = self.o, self.T, self.S, self.tq, self.tk
        i = np.arange(self.Tp)
        pos = i + o.offset
        klo = np.zeros(self.Tp, np.int64)
        khi = np.full(self.Tp, S, np.int64)
        if o.causal:
            khi = (pos + 1) // o.key_stride
        if o.window is not None:
            klo = np.maximum(klo, pos - o.window[0])
            khi = np.minimum(khi, pos + o.window[1] + 1)
        klo, khi = np.clip(klo, 0, S), np.clip(khi, 0, S)
        valid = i < T
        seen = valid & (klo < khi)
        klo, khi = np.where(seen, klo, 0), np.where(seen, khi, 0)  # rows that see nothing: [0, 0)
        start = np.arange(self.nkt) * tk
        # Tile pairs some row sees part of (the rows' ranges are monotone: their hull is exact), and
        # tile pairs every valid row sees whole.
        lo = np.where(seen, klo, S).reshape(self.nqt, tq).min(axis=1)
        hi = khi.reshape(self.nqt, tq).max(axis=1)
        lo_all = np.where(valid, klo, 0).reshape(self.nqt, tq).max(axis=1)
        hi_all = np.where(valid, khi, S).reshape(self.nqt, tq).min(axis=1)
        self.s_any = (start[None, :] < hi[:, None]) & (start[None, :] + tk > lo[:, None])  # [nqt, nkt], static
        self.s_all = (lo_all[:, None] <= start[None, :]) & (start[None, :] + tk <= hi_all[:, None])
        self.klo = jnp.asarray(klo.reshape(self.nqt, tq), jnp.int32)
        self.khi = jnp.asarray(khi.reshape(self.nqt, tq), jnp.int32)

    def _lanes(self, mask: Any, qseg: Any, kvseg: Any) -> None:
        o, B, tq, tk, nqt, nkt = self.o, self.B, self.tq, self.tk, self.nqt, self.nkt
        self.sub = None
        if mask is None:
            m_any = m_all = jnp.ones((1, 1, nqt, nkt), bool)
        else:
            rq, rk = tq // o.q_block, tk // o.kv_block
            lb, lh = mask.shape[:2]
            nq_units, nk_units = nqt * rq, nkt * rk
            pad_f = _pad_axis(_pad_axis(mask, 2, nq_units, False), 3, nk_units, False)
            pad_t = _pad_axis(_pad_axis(mask, 2, nq_units, True), 3, nk_units, True)
            m_any = pad_f.reshape(lb, lh, nqt, rq, nkt, rk).any(axis=(3, 5))
            m_all = pad_t.reshape(lb, lh, nqt, rq, nkt, rk).all(axis=(3, 5))
            if rq * rk > 1:  # a tile spans several mask blocks: partial tiles need the sub-blocks
                self.sub = pad_f.reshape(lb, lh, nqt, rq, nkt, rk)
        self.seg = qseg is not None
        self.qseg: Any = None
        self.kvseg: Any = None
        if qseg is not None:
            qs = jnp.pad(qseg, ((0, 0), (0, self.Tp - self.T)), mode="edge").reshape(B, nqt, tq)
            ks = jnp.pad(kvseg, ((0, 0), (0, self.Sp - self.S)), mode="edge").reshape(B, nkt, tk)
            overlap = (qs.min(-1)[:, :, None] <= ks.max(-1)[:, None, :]) & (
                ks.min(-1)[:, None, :] <= qs.max(-1)[:, :, None]
            )
            m_any = m_any & overlap[:, None]
            self.qseg = qs.transpose(1, 0, 2)  # [nqt, B, tq]
            self.kvseg = ks.transpose(1, 0, 2)[:, :, None]  # [nkt, B, 1, tk]
        admitted = m_any & jnp.asarray(self.s_any)
        full = admitted & m_all & jnp.asarray(self.s_all) & (not self.seg)
        partial_ = admitted & ~full
        self.Lb, self.Lh = admitted.shape[:2]
        if self.sub is not None and self.sub.shape[:2] != (self.Lb, self.Lh):
            self.sub = jnp.broadcast_to(self.sub, (self.Lb, self.Lh, *self.sub.shape[2:]))
        self.shared = self.Lb == 1 and self.Lh == 1
        self.Gl = self.G if self.Lh > 1 else 1
        idx_p, cnt_p = _lists(partial_)
        idx_f, cnt_f = _lists(full)
        # Scanned along query tiles: [nqt, Lb, Lh, nkt] lists, [nqt, Lb, Lh] counts, [nqt] trip counts.
        self.idx_p, self.cnt_p = idx_p.transpose(2, 0, 1, 3), cnt_p.transpose(2, 0, 1)
        self.idx_f, self.cnt_f = idx_f.transpose(2, 0, 1, 3), cnt_f.transpose(2, 0, 1)
        self.trip_p, self.trip_f = cnt_p.max(axis=(0, 1)), cnt_f.max(axis=(0, 1))
        self.sub_q = None if self.sub is None else self.sub.transpose(2, 0, 1, 3, 4, 5)  # [nqt, Lb, Lh, rq, nkt, rk]

    # ---- layout -------------------------------------------------------------------------------

    def q_tiles(self, x: jax.Array, scale: bool = False) -> jax.Array:
        """``[B, T, H, E]`` -> ``[nqt, B, K, G, tq, E]`` (times the softmax scale where that is exact enough)."""
        if scale and self.prescale:
            x = (x.astype(F32) * F32(self.o.scale)).astype(x.dtype)
        e = x.shape[-1]
        x = _pad_axis(x, 1, self.Tp).reshape(self.B, self.nqt, self.tq, self.K, self.G, e)
        return x.transpose(1, 0, 3, 4, 2, 5)

    def q_untile(self, x: jax.Array) -> jax.Array:
        e = x.shape[-1]
        return x.transpose(1, 0, 4, 2, 3, 5).reshape(self.B, self.Tp, self.H, e)[:, : self.T]

    def kv_tiles(self, x: jax.Array) -> jax.Array:
        """``[B, S, K, E]`` -> ``[nkt, B, K, tk, E]``."""
        e = x.shape[-1]
        return _pad_axis(x, 1, self.Sp).reshape(self.B, self.nkt, self.tk, self.K, e).transpose(1, 0, 3, 2, 4)

    def kv_untile(self, x: jax.Array) -> jax.Array:
        e = x.shape[-1]
        return x.transpose(1, 0, 3, 2, 4).reshape(self.B, self.Sp, self.K, e)[:, : self.S]

    def rows_tiles(self, x: jax.Array) -> jax.Array:
        """``[B, H, T]`` -> ``[nqt, B, K, G, tq]``."""
        x = _pad_axis(x, 2, self.Tp).reshape(self.B, self.K, self.G, self.nqt, self.tq)
        return x.transpose(3, 0, 1, 2, 4)

    def rows_untile(self, x: jax.Array) -> jax.Array:
        return x.transpose(1, 2, 3, 0, 4).reshape(self.B, self.H, self.Tp)[:, :, : self.T]

    # ---- lanes --------------------------------------------------------------------------------

    def lane(self, x: jax.Array) -> jax.Array:
        """``[Lb, Lh, ...]`` -> ``[Lb, K|1, Gl, ...]`` (query heads grouped by their kv head)."""
        rest = x.shape[2:]
        return x.reshape(self.Lb, self.K, self.G, *rest) if self.Lh > 1 else x.reshape(self.Lb, 1, 1, *rest)

    def take(self, x: jax.Array, j: jax.Array) -> jax.Array:
        """Tile ``j`` of ``x [n, B, Kx, ...]`` for every lane: ``[B, Kx|K, Gl, ...]``."""
        if self.shared:
            return x[j[0, 0, 0]][:, :, None]
        b_ix = jnp.arange(x.shape[1]).reshape(-1, 1, 1)
        k_ix = jnp.arange(x.shape[2]).reshape(1, -1, 1)
        return x[j, b_ix, k_ix]

    def add(self, acc: jax.Array, j: jax.Array, update: jax.Array) -> jax.Array:
        """``acc [n, B, K, tk, E]`` plus ``update [B, K, Gl, tk, E]`` at tile ``j`` of every lane."""
        if self.shared:
            return acc.at[j[0, 0, 0]].add(update[:, :, 0])
        b_ix = jnp.arange(self.B).reshape(-1, 1, 1)
        k_ix = jnp.arange(self.K).reshape(1, -1, 1)
        return acc.at[j, b_ix, k_ix].add(update)

    def mm(self, a: jax.Array, b: jax.Array, spec: str, out: tuple[int, ...]) -> jax.Array:
        """A float32 matmul batched over ``B * K * Gl``: ``a``/``b`` viewed as ``(batch, rows, cols)``."""
        x = self.B * self.K * self.Gl
        a3 = a.reshape(x, -1, a.shape[-1])
        b3 = b.reshape(x, -1, b.shape[-1])
        return jnp.einsum(spec, a3, b3, preferred_element_type=F32).reshape(out)

    # ---- one tile -----------------------------------------------------------------------------

    def scores(self, q_tile: jax.Array, k_sel: jax.Array, allowed: Any) -> tuple[jax.Array, Any]:
        """Float32 scores ``[B, K, G, tq, tk]`` (``-inf`` where not ``allowed``) and the soft cap's ``tanh``."""
        o, B, K, G, tq, tk = self.o, self.B, self.K, self.G, self.tq, self.tk
        s = self.mm(q_tile, k_sel, "xmd,xnd->xmn", (B, K, G, tq, tk))
        if not self.prescale:
            s = s * F32(o.scale)
        t = None
        if o.soft_cap is not None:
            t = jnp.tanh(s / F32(o.soft_cap))
            s = F32(o.soft_cap) * t
        if allowed is not None:
            s = jnp.where(allowed, s, NEG_INF)
        return s, t

    def allowed(self, xs: dict[str, Any], j: jax.Array, n: Any, partial_: bool) -> Any:
        """What a query tile may see of key tile ``j`` (per lane), broadcastable to ``[B, K, G, tq, tk]``."""
        if not partial_:
            if self.shared:
                return None  # the loop bounds are exact and full tiles need no mask
            return self.lane(n < xs["cnt_f"])[..., None, None]
        active = self.lane(n < xs["cnt_p"])[..., None, None]
        cols = j[..., None, None] * self.tk + jnp.arange(self.tk, dtype=jnp.int32)  # [Lb, K|1, Gl, 1, tk]
        allowed = active & (cols >= xs["klo"][:, None]) & (cols < xs["khi"][:, None])
        if self.sub_q is not None:
            rq, rk = self.tq // self.o.q_block, self.tk // self.o.kv_block
            jl = j.reshape(self.Lb, self.Lh)
            sub = jnp.take_along_axis(xs["sub"], jl[:, :, None, None, None], axis=3)[:, :, :, 0]  # [Lb, Lh, rq, rk]
            sub = self.lane(sub).reshape(*j.shape, rq, 1, rk, 1)
            sub = jnp.broadcast_to(sub, (*j.shape, rq, self.o.q_block, rk, self.o.kv_block))
            allowed = allowed & sub.reshape(*j.shape, self.tq, self.tk)
        if self.seg:
            kvs = self.take(self.kvseg, j)  # [B, 1|K, Gl, tk]
            allowed = allowed & (xs["qseg"][:, None, None, :, None] == kvs[..., None, :])
        return allowed

    def visit(self, xs: dict[str, Any], step: Any, carry: Any) -> Any:
        """``carry = step(j, carry, allowed)`` over the partial, then the full key tiles of one query tile."""
        for part in (True, False):
            idx, trip = (xs["idx_p"], xs["trip_p"]) if part else (xs["idx_f"], xs["trip_f"])

            def body(n: Any, c: Any, idx: jax.Array = idx, part: bool = part) -> Any:
                j = self.lane(idx[:, :, n])
                return step(j, c, self.allowed(xs, j, n, part))

            carry = lax.fori_loop(0, trip, body, carry)
        return carry

    def xs(self) -> dict[str, Any]:
        """The per-query-tile arrays the scans walk over."""
        return {
            "qi": jnp.arange(self.nqt, dtype=jnp.int32),
            "klo": self.klo,
            "khi": self.khi,
            "idx_p": self.idx_p,
            "cnt_p": self.cnt_p,
            "trip_p": self.trip_p,
            "idx_f": self.idx_f,
            "cnt_f": self.cnt_f,
            "trip_f": self.trip_f,
            "sub": self.sub_q,
            "qseg": self.qseg,
        }


# ---- forward --------------------------------------------------------------------------------------


def forward(o: Options, arrays: tuple[Any, ...]) -> tuple[jax.Array, jax.Array]:
    """``(out [B, T, H, Dv], lse [B, H, T] float32)``; out in query.dtype (float32 with ``out_f32``)."""
    q, k, v, mask, qseg, kvseg = arrays
    c = _Plan(o, q, k, v, mask, qseg, kvseg, o.fwd_tiles)
    B, K, G, tq, Dv = c.B, c.K, c.G, c.tq, c.Dv
    kt, vt = c.kv_tiles(k), c.kv_tiles(v)
    xs = c.xs()
    xs["q"] = c.q_tiles(q, scale=True)
    out_dtype = F32 if o.out_f32 else q.dtype

    def per_q(_: Any, x: dict[str, Any]) -> Any:
        def step(j: jax.Array, carry: Any, allowed: Any) -> Any:
            m, l, acc = carry
            s, _ = c.scores(x["q"], c.take(kt, j), allowed)
            m_new = jnp.maximum(m, s.max(axis=-1))
            m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)  # nothing seen yet: p = 0 below
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            l = alpha * l + p.sum(axis=-1)
            pv = c.mm(p.astype(v.dtype), c.take(vt, j), "xmn,xne->xme", (B, K, G, tq, Dv))
            return m_new, l, acc * alpha[..., None] + pv

        init = (jnp.full((B, K, G, tq), NEG_INF, F32), jnp.zeros((B, K, G, tq), F32), jnp.zeros((B, K, G, tq, Dv), F32))
        m, l, acc = c.visit(x, step, init)
        seen = l > 0
        out = acc / jnp.where(seen, l, 1.0)[..., None]
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), NEG_INF)
        return None, (out.astype(out_dtype), lse)

    _, (out, lse) = lax.scan(per_q, None, xs)
    return c.q_untile(out), c.rows_untile(lse)


# ---- backward -------------------------------------------------------------------------------------


def backward(o: Options, arrays: tuple[Any, ...], out: jax.Array, lse: jax.Array, dout: jax.Array) -> tuple[Any, ...]:
    """``(dq, dk, dv)``, query-major: ``dQ`` per query tile, ``dK``/``dV`` scatter-added into float32 carries."""
    q, k, v, mask, qseg, kvseg = arrays
    c = _Plan(o, q, k, v, mask, qseg, kvseg, o.bwd_tiles)
    B, K, G, tq, tk, D, Dv, Gl = c.B, c.K, c.G, c.tq, c.tk, c.D, c.Dv, c.Gl
    dout = dout.astype(q.dtype)
    kt, vt = c.kv_tiles(k), c.kv_tiles(v)
    xs = c.xs()
    xs["q"], xs["do"] = c.q_tiles(q, scale=True), c.q_tiles(dout)
    xs["delta"] = c.rows_tiles(jnp.einsum("bthd,bthd->bht", dout.astype(F32), out.astype(F32)))
    xs["lse"] = c.rows_tiles(jnp.where(jnp.isfinite(lse), lse, 0.0))  # rows without keys: P = 0 anyway
    scale = F32(o.scale)

    def per_q(carry: Any, x: dict[str, Any]) -> Any:
        def step(j: jax.Array, inner: Any, allowed: Any) -> Any:
            dq, dk, dv = inner
            k_sel, v_sel = c.take(kt, j), c.take(vt, j)
            s, t = c.scores(x["q"], k_sel, allowed)
            p = jnp.exp(s - x["lse"][..., None])
            dp = c.mm(x["do"], v_sel, "xme,xne->xmn", (B, K, G, tq, tk))
            dv = c.add(dv, j, c.mm(p.astype(dout.dtype), x["do"], "xmn,xme->xne", (B, K, Gl, tk, Dv)))
            ds = p * (dp - x["delta"][..., None])
            if t is not None:
                ds = ds * (1.0 - t * t)
            if not c.prescale:  # else q is scaled already, and dq is scaled once at the end
                ds = ds * scale
            dq = dq + c.mm(ds.astype(k.dtype), k_sel, "xmn,xnd->xmd", (B, K, G, tq, D))
            dk = c.add(dk, j, c.mm(ds.astype(q.dtype), x["q"], "xmn,xmd->xnd", (B, K, Gl, tk, D)))
            return dq, dk, dv

        dk, dv = carry
        dq, dk, dv = c.visit(x, step, (jnp.zeros((B, K, G, tq, D), F32), dk, dv))
        if c.prescale:
            dq = dq * scale
        return (dk, dv), dq.astype(q.dtype)

    init = (jnp.zeros((c.nkt, B, K, tk, D), F32), jnp.zeros((c.nkt, B, K, tk, Dv), F32))
    (dk, dv), dq = lax.scan(per_q, init, xs)
    return c.q_untile(dq), c.kv_untile(dk).astype(k.dtype), c.kv_untile(dv).astype(v.dtype)


# ---- custom_vjp -----------------------------------------------------------------------------------


def _arrays(arrays: tuple[Any, ...]) -> tuple[Any, ...]:
    """NumPy inputs (``jax.test_util.check_grads`` passes them) as JAX arrays, so tracers can index them."""
    return tuple(None if x is None else jnp.asarray(x) for x in arrays)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention(o: Options, q, k, v, mask, qseg, kvseg):  # noqa: ANN001, ANN201
    """Sparse blockwise attention; differentiable in ``q``, ``k``, ``v`` (the rest get no cotangent)."""
    return forward(o, _arrays((q, k, v, mask, qseg, kvseg)))[0]


def _attention_fwd(o: Options, *primals: Any) -> tuple[jax.Array, Any]:
    arrays = _arrays(primals)
    out, lse = forward(o, arrays)
    return out, (arrays, out, lse)


def _attention_bwd(o: Options, res: Any, g: Any) -> tuple[Any, ...]:
    arrays, out, lse = res
    dq, dk, dv = backward(o, arrays, out, lse, jnp.asarray(g))
    return (dq, dk, dv, None, None, None)


attention.defvjp(_attention_fwd, _attention_bwd)
