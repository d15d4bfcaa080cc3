"""NSA's selected branch in plain JAX: every query token attends its own blocks, gathered, in O(T) memory.

Each query token ``i`` (kv head ``k``) has up to ``N`` selected key blocks; the ``G`` query heads of the
group share them, so the work is a batch, over ``B * tq * K`` tokens of a query tile, of ``[G, D] x
[D, ns * bs]`` matmuls against the ``ns`` blocks of one slot group, gathered from ``[B, NB, K, bs, D]``.

Forward: ``lax.scan`` over query tiles of ``tq`` tokens; for each, a ``lax.fori_loop`` over slot groups
of ``ns`` slots (only as many groups as the tile's tokens use: the slots are sorted so that unused
ones come last), with an online softmax in float32. It returns the output and the log-sum-exp.

Backward: ``jax.custom_vjp`` keeps ``(inputs, out, lse)``. The same loops recompute ``P = exp(s - lse)``,
write each tile's ``dQ``, and scatter-add the gathered blocks' ``dK``/``dV`` into float32 carries
``[B, NB, K, bs, E]``. Plain autodiff of the gathered form would instead keep the gathered keys,
values and probabilities of every tile, ``O(T * N * bs * (D + G))`` memory: hundreds of times the inputs.
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

F32 = jnp.float32
NEG_INF = -jnp.inf

# Default tiles, measured on a 2-core CPU (B=1, T=2048, H=16, K=1, D=64, N=16, block 64): about 256 keys
# (4 blocks) per step and 512K gathered key elements (B * tq * K * keys * D) per step, i.e. 32 tokens,
# were fastest for forward plus backward; 1024 keys per step was twice as slow in the backward.
KEYS_PER_STEP = 256
GATHER_ELEMENTS = 1 << 19
MIN_Q_TILE = 8


@dataclasses.dataclass(frozen=True)
class Options:
    """Static (hashable) options of one call."""

    scale: float
    block_size: int
    causal: bool = True
    fwd_tiles: tuple[int | None, int | None] = (None, None)  # (query tokens, keys = slots * block_size)
    bwd_tiles: tuple[int | None, int | None] = (None, None)
    out_f32: bool = False


def default_tiles(b: int, t: int, kh: int, n: int, bs: int, d: int) -> tuple[int, int]:
    """Heuristic ``(tq, ns * bs)``: ``KEYS_PER_STEP`` keys per step, as many tokens as ``GATHER_ELEMENTS`` allow."""
    ns = min(n, max(1, KEYS_PER_STEP // bs))
    tq = max(MIN_Q_TILE, GATHER_ELEMENTS // max(1, b * kh * ns * bs * d))
    return min(tq, t), ns * bs


def clean_indices(block_indices: jax.Array, block_counts: Any, n_blocks: int) -> jax.Array:
    """The contract's block set per token as ``[B, T, K, N]`` int32: sorted, distinct, unused slots ``-1`` last."""
    n = block_indices.shape[-1]
    count = n if block_counts is None else block_counts
    used = (jnp.arange(n) < jnp.asarray(count)[..., None]) & (block_indices >= 0) & (block_indices < n_blocks)
    big = jnp.iinfo(jnp.int32).max
    idx = jnp.sort(jnp.where(used, block_indices, big).astype(jnp.int32), axis=-1)
    dup = jnp.concatenate([jnp.zeros_like(idx[..., :1], bool), idx[..., 1:] == idx[..., :-1]], axis=-1)
    idx = jnp.sort(jnp.where(dup, big, idx), axis=-1)
    return jnp.where(idx == big, -1, idx).astype(jnp.int32)


class _Plan:
    """Tiles and layouts of one pass."""

    def __init__(self, o: Options, q: jax.Array, k: jax.Array, v: jax.Array, idx: jax.Array,
                 tiles: tuple[int | None, int | None]) -> None:  # fmt: skip
        self.o = o
        self.B, self.T, self.H, self.D = q.shape
        self.S, self.K = k.shape[1], k.shape[2]
        self.Dv = v.shape[-1]
        self.G = self.H // self.K
        self.N = idx.shape[-1]
        self.bs = o.block_size
        self.nb = cdiv(self.S, self.bs)
        dq, dk = default_tiles(self.B, self.T, self.K, self.N, self.bs, self.D)
        self.tq = max(1, min(tiles[0] or dq, self.T))
        self.ns = max(1, min((tiles[1] or dk) // self.bs, self.N))
        self.ng = cdiv(self.N, self.ns)
        self.nqt = cdiv(self.T, self.tq)
        self.Tp = self.nqt * self.tq
        self.prescale = q.dtype == F32 or math.frexp(o.scale)[0] == 0.5
        idx = jnp.pad(idx, ((0, 0), (0, self.Tp - self.T), (0, 0), (0, self.ng * self.ns - self.N)), constant_values=-1)
        self.idx = idx.reshape(self.B, self.nqt, self.tq, self.K, self.ng * self.ns).transpose(1, 0, 2, 3, 4)
        # Slot groups a tile uses: unused slots are last, so it is the tile's longest run of used ones.
        self.groups = cdiv((self.idx >= 0).sum(axis=-1).max(axis=(1, 2, 3)), self.ns)  # [nqt]
        pos = jnp.arange(self.Tp, dtype=jnp.int32) + (self.S - self.T)  # aligned key position of every row
        self.pos = jnp.where(jnp.arange(self.Tp) < self.T, pos, -1).reshape(self.nqt, self.tq)

    def q_tiles(self, x: jax.Array, scale: bool = False) -> jax.Array:
        """``[B, T, H, E]`` -> ``[nqt, B, tq, K, G, E]``."""
        if scale and self.prescale:
            x = (x.astype(F32) * F32(self.o.scale)).astype(x.dtype)
        e = x.shape[-1]
        x = jnp.pad(x, ((0, 0), (0, self.Tp - self.T), (0, 0), (0, 0)))
        return x.reshape(self.B, self.nqt, self.tq, self.K, self.G, e).transpose(1, 0, 2, 3, 4, 5)

    def q_untile(self, x: jax.Array) -> jax.Array:
        e = x.shape[-1]
        return x.transpose(1, 0, 2, 3, 4, 5).reshape(self.B, self.Tp, self.H, e)[:, : self.T]

    def rows_tiles(self, x: jax.Array) -> jax.Array:
        """``[B, T, H]`` -> ``[nqt, B, tq, K, G]``."""
        x = jnp.pad(x, ((0, 0), (0, self.Tp - self.T), (0, 0)))
        return x.reshape(self.B, self.nqt, self.tq, self.K, self.G).transpose(1, 0, 2, 3, 4)

    def rows_untile(self, x: jax.Array) -> jax.Array:
        return x.transpose(1, 0, 2, 3, 4).reshape(self.B, self.Tp, self.H)[:, : self.T]

    def kv_blocks(self, x: jax.Array) -> jax.Array:
        """``[B, S, K, E]`` -> ``[B, NB, K, bs, E]``."""
        e = x.shape[-1]
        x = jnp.pad(x, ((0, 0), (0, self.nb * self.bs - self.S), (0, 0), (0, 0)))
        return x.reshape(self.B, self.nb, self.bs, self.K, e).transpose(0, 1, 3, 2, 4)

    def kv_unblock(self, x: jax.Array) -> jax.Array:
        e = x.shape[-1]
        return x.transpose(0, 1, 3, 2, 4).reshape(self.B, self.nb * self.bs, self.K, e)[:, : self.S]

    def group(self, idx_tile: jax.Array, gi: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Slots of group ``gi``: ``(safe indices [B, tq, K, ns], admitted [B, tq, K, ns, bs], key index [B, tq, K, ns, bs])``."""
        sel = lax.dynamic_slice_in_dim(idx_tile, gi * self.ns, self.ns, axis=3)  # [B, tq, K, ns]
        safe = jnp.maximum(sel, 0)
        keys = safe[..., None] * self.bs + jnp.arange(self.bs, dtype=jnp.int32)  # [B, tq, K, ns, bs]
        allowed = (sel >= 0)[..., None] & (keys < self.S)
        return safe, allowed, keys

    def gather(self, blocks: jax.Array, safe: jax.Array) -> jax.Array:
        """``[B, NB, K, bs, E]`` at ``safe [B, tq, K, ns]`` -> ``[B, tq, K, ns * bs, E]``."""
        b_ix = jnp.arange(self.B).reshape(-1, 1, 1, 1)
        k_ix = jnp.arange(self.K).reshape(1, 1, -1, 1)
        g = blocks[b_ix, safe, k_ix]  # [B, tq, K, ns, bs, E]
        return g.reshape(*g.shape[:3], self.ns * self.bs, g.shape[-1])

    def scatter_add(self, acc: jax.Array, safe: jax.Array, update: jax.Array) -> jax.Array:
        """``acc [B, NB, K, bs, E]`` plus ``update [B, tq, K, ns * bs, E]`` at the blocks ``safe``."""
        b_ix = jnp.arange(self.B).reshape(-1, 1, 1, 1)
        k_ix = jnp.arange(self.K).reshape(1, 1, -1, 1)
        return acc.at[b_ix, safe, k_ix].add(update.reshape(*safe.shape, self.bs, update.shape[-1]))

    def mm(self, a: jax.Array, b: jax.Array, spec: str, out: tuple[int, ...]) -> jax.Array:
        """A float32 matmul batched over the ``B * tq * K`` tokens of a tile."""
        x = self.B * self.tq * self.K
        a3 = a.reshape(x, -1, a.shape[-1])
        b3 = b.reshape(x, -1, b.shape[-1])
        return jnp.einsum(spec, a3, b3, preferred_element_type=F32).reshape(out)

    def scores(self, q_tile: jax.Array, k_sel: jax.Array, pos: jax.Array, allowed: jax.Array,
               keys: jax.Array) -> jax.Array:  # fmt: skip
        """Float32 scores ``[B, tq, K, G, ns * bs]``, ``-inf`` where not admitted."""
        m = self.ns * self.bs
        s = self.mm(q_tile, k_sel, "xgd,xmd->xgm", (self.B, self.tq, self.K, self.G, m))
        if not self.prescale:
            s = s * F32(self.o.scale)
        if self.o.causal:
            allowed = allowed & (keys <= pos[None, :, None, None, None])
        return jnp.where(allowed.reshape(self.B, self.tq, self.K, 1, m), s, NEG_INF)


def forward(o: Options, arrays: tuple[Any, ...]) -> tuple[jax.Array, jax.Array]:
    """``(out [B, T, H, Dv], lse [B, T, H] float32)``; ``idx`` must come from ``clean_indices``."""
    q, k, v, idx = arrays
    c = _Plan(o, q, k, v, idx, o.fwd_tiles)
    B, tq, K, G, Dv = c.B, c.tq, c.K, c.G, c.Dv
    kb, vb = c.kv_blocks(k), c.kv_blocks(v)
    xs = {"q": c.q_tiles(q, scale=True), "idx": c.idx, "groups": c.groups, "pos": c.pos}

    def per_q(_: Any, x: dict[str, Any]) -> Any:
        def step(gi: Any, carry: Any) -> Any:
            m, l, acc = carry
            safe, allowed, keys = c.group(x["idx"], gi)
            s = c.scores(x["q"], c.gather(kb, safe), x["pos"], allowed, keys)
            m_new = jnp.maximum(m, s.max(axis=-1))
            m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            l = alpha * l + p.sum(axis=-1)
            pv = c.mm(p.astype(v.dtype), c.gather(vb, safe), "xgm,xme->xge", (B, tq, K, G, Dv))
            return m_new, l, acc * alpha[..., None] + pv

        init = (jnp.full((B, tq, K, G), NEG_INF, F32), jnp.zeros((B, tq, K, G), F32), jnp.zeros((B, tq, K, G, Dv), F32))
        m, l, acc = lax.fori_loop(0, x["groups"], step, init)
        seen = l > 0
        out = acc / jnp.where(seen, l, 1.0)[..., None]
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), NEG_INF)
        return None, (out.astype(F32 if o.out_f32 else q.dtype), lse)

    _, (out, lse) = lax.scan(per_q, None, xs)
    return c.q_untile(out), c.rows_untile(lse)


def backward(o: Options, arrays: tuple[Any, ...], out: jax.Array, lse: jax.Array, dout: jax.Array) -> tuple[Any, ...]:
    """``(dq, dk, dv)``."""
    q, k, v, idx = arrays
    c = _Plan(o, q, k, v, idx, o.bwd_tiles)
    B, tq, K, G, D, Dv, m = c.B, c.tq, c.K, c.G, c.D, c.Dv, c.ns * c.bs
    dout = dout.astype(q.dtype)
    kb, vb = c.kv_blocks(k), c.kv_blocks(v)
    delta = jnp.einsum("bthd,bthd->bth", dout.astype(F32), out.astype(F32))
    xs = {
        "q": c.q_tiles(q, scale=True),
        "do": c.q_tiles(dout),
        "delta": c.rows_tiles(delta),
        "lse": c.rows_tiles(jnp.where(jnp.isfinite(lse), lse, 0.0)),  # rows without keys: P = 0 anyway
        "idx": c.idx,
        "groups": c.groups,
        "pos": c.pos,
    }
    scale = F32(o.scale)

    def per_q(carry: Any, x: dict[str, Any]) -> Any:
        def step(gi: Any, inner: Any) -> Any:
            dq, dk, dv = inner
            safe, allowed, keys = c.group(x["idx"], gi)
            k_sel, v_sel = c.gather(kb, safe), c.gather(vb, safe)
            s = c.scores(x["q"], k_sel, x["pos"], allowed, keys)
            p = jnp.exp(s - x["lse"][..., None])
            dp = c.mm(x["do"], v_sel, "xge,xme->xgm", (B, tq, K, G, m))
            dv = c.scatter_add(dv, safe, c.mm(p.astype(dout.dtype), x["do"], "xgm,xge->xme", (B, tq, K, m, Dv)))
            ds = p * (dp - x["delta"][..., None])
            if not c.prescale:
                ds = ds * scale
            dq = dq + c.mm(ds.astype(k.dtype), k_sel, "xgm,xmd->xgd", (B, tq, K, G, D))
            dk = c.scatter_add(dk, safe, c.mm(ds.astype(q.dtype), x["q"], "xgm,xgd->xmd", (B, tq, K, m, D)))
            return dq, dk, dv

        dk, dv = carry
        dq, dk, dv = lax.fori_loop(0, x["groups"], step, (jnp.zeros((B, tq, K, G, D), F32), dk, dv))
        if c.prescale:
            dq = dq * scale
        return (dk, dv), dq.astype(q.dtype)

    init = (jnp.zeros((B, c.nb, K, c.bs, D), F32), jnp.zeros((B, c.nb, K, c.bs, Dv), F32))
    (dk, dv), dq = lax.scan(per_q, init, xs)
    return c.q_untile(dq), c.kv_unblock(dk).astype(k.dtype), c.kv_unblock(dv).astype(v.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def selected_attention(o: Options, q, k, v, idx):  # noqa: ANN001, ANN201
    """The selected branch; ``idx`` from ``clean_indices``. Differentiable in ``q``, ``k``, ``v``."""
    return forward(o, (q, k, v, idx))[0]


def _fwd(o: Options, q: Any, k: Any, v: Any, idx: Any) -> tuple[jax.Array, Any]:
    arrays = tuple(jnp.asarray(x) for x in (q, k, v, idx))
    out, lse = forward(o, arrays)
    return out, (arrays, out, lse)


def _bwd(o: Options, res: Any, g: Any) -> tuple[Any, ...]:
    arrays, out, lse = res
    dq, dk, dv = backward(o, arrays, out, lse, jnp.asarray(g))
    return (dq, dk, dv, None)


selected_attention.defvjp(_fwd, _bwd)
