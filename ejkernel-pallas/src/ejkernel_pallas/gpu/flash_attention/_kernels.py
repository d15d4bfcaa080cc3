"""The Mosaic GPU forward kernel of ``flash_attention`` (Hopper: TMA, mbarriers, wgmma) and its backward.

Layout (what ``interface`` hands over): q ``[B, Tp, H, D]``, k/v ``[B, Sp, K, D]``, padded so that
Tp is a multiple of the CTA's query rows (two 64-row tiles) and Sp of the key block; D is 64, 128
or 256. Keys at or past the true length ``s`` are masked; query rows past ``t`` are sliced off later.

One CTA (grid: query heads x query tiles x batch) runs three warpgroups:

* two consumers, each owning 64 query rows: ``S = Q K^T`` and ``O += P V`` on the tensor cores
  (wgmma), the online softmax in float32 between them. The two take turns on the tensor cores
  (a two-party "schedule" barrier) so that one's softmax overlaps the other's matrix products.
* one producer that streams K and V blocks into a ring of ``stages`` SMEM slots with TMA copies;
  a slot is refilled once both consumers have arrived on its "free" barrier.

Causal attention (bottom-right aligned: key j is admitted for row i iff ``j <= i + s - t``) visits
only the key blocks that some row of the tile admits; the mask is applied only on the blocks that
straddle the diagonal (or the padded end of the keys). A consumer whose rows need fewer blocks than
its CTA's other consumer keeps arriving on the barriers for the rest, so the ring keeps turning.

Softmax runs in base 2: the running max ``m`` is kept in units of ``log2(e) * scale * q.k``, so each
probability is one ``exp2(fma)``. The log-sum-exp saved for the backward is natural-log, ``-inf`` on
rows that admit no key (their output is exactly 0).

The backward (``backward``) recomputes probabilities block by block in plain ``jax.numpy`` from
``(out, lse)``: O(T*block) extra memory, never the [T, S] matrix. It is not a Mosaic GPU kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

# Rows of one consumer warpgroup's query tile: the M of a wgmma.
BLOCK_Q = 64
# Consumers per CTA; the CTA's query tile is CONSUMERS * BLOCK_Q rows.
CONSUMERS = 2
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
# The running max starts finite so that a row whose keys are all masked (scores -inf) never
# computes inf - inf; its sum stays 0 and its output is written as 0.
_M_INIT = -1e30
# In JAX's Mosaic GPU interpret mode (CPU) the two matrix products are ``jnp.dot`` on the SMEM tiles
# instead of wgmma: its interpreter (jax 0.10-0.11) has neither ``run_state`` (an accumulator fed in)
# nor transposed wgmma operands, and register layouts do not exist there. Everything else (TMA copies,
# the barriers and the warpgroups' hand-offs, masking, the online softmax) runs as on the GPU.

# Register budgets after the warpgroups specialise (64 Ki registers per SM, 128 threads each).
_CONSUMER_REGS, _PRODUCER_REGS = 232, 40


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Everything static about one call (hashable: it closes over no array)."""

    t: int  # true query length
    s: int  # true key length
    tp: int  # padded query length (multiple of CONSUMERS * BLOCK_Q)
    sp: int  # padded key length (multiple of bk)
    d: int  # padded head dim: 64, 128 or 256
    bk: int  # key block
    stages: int  # SMEM slots of the K/V ring
    group: int  # query heads per kv head
    scale: float
    causal: bool
    dtype: str  # "bfloat16" or "float16"

    @property
    def offset(self) -> int:
        """Causal alignment: row i admits keys j <= i + offset."""
        return self.s - self.t

    @property
    def q_tiles(self) -> int:
        return self.tp // (CONSUMERS * BLOCK_Q)

    @property
    def smem_bytes(self) -> int:
        item = 2
        return (CONSUMERS * BLOCK_Q * self.d + 2 * self.stages * self.bk * self.d) * item + CONSUMERS * BLOCK_Q * 4


# Counts that do not depend on the CTA stay Python ints: a concrete jnp scalar closed over by the
# kernel becomes a captured constant, which the Mosaic GPU lowering rejects.


def _key_blocks(geo: Geometry, row_end: Any) -> Any:
    """Key blocks that rows ``[.., row_end)`` need: all of them, or (causal) up to the last admitted key."""
    if not geo.causal:
        return geo.sp // geo.bk
    keys = jnp.clip(row_end + geo.offset, 0, geo.s)
    return lax.div(keys + (geo.bk - 1), geo.bk)


def _unmasked_blocks(geo: Geometry, row_start: Any, blocks: Any) -> Any:
    """Leading key blocks that every row from ``row_start`` on admits whole (no mask needed)."""
    whole = geo.s // geo.bk  # blocks with no padded key
    if not geo.causal:
        return whole
    # Block n is admitted whole by row r iff (n + 1) * bk - 1 <= r + offset.
    admitted = lax.div(jnp.maximum(row_start + geo.offset + 1, 0), geo.bk)
    return jnp.minimum(jnp.minimum(admitted, whole), blocks)


def _when(cond: Any, fn: Any) -> None:
    """``pl.when`` that also takes a Python bool (a count known when tracing)."""
    if isinstance(cond, bool):
        if cond:
            fn()
    else:
        pl.when(cond)(fn)


def _max(a: Any, b: int) -> Any:
    return max(a, b) if isinstance(a, int) else jnp.maximum(a, b)


def _forward_body(
    geo: Geometry,
    interpreted: bool,
    q_ref: Any,
    k_ref: Any,
    v_ref: Any,
    o_ref: Any,
    lse_ref: Any,
    qo_smem: Any,
    k_smem: Any,
    v_smem: Any,
    lse_smem: Any,
    q_ready: Any,
    k_ready: Any,
    v_ready: Any,
    k_free: Any,
    v_free: Any,
    turn: Any,
) -> None:
    dtype = jnp.dtype(geo.dtype)
    bq, bk, d, stages = BLOCK_Q, geo.bk, geo.d, geo.stages
    head, batch, wg = lax.axis_index("heads"), lax.axis_index("batch"), lax.axis_index("wg")
    tile = lax.axis_index("q_tiles")
    if geo.causal:  # the longest rows first: the last CTAs to start are the short ones
        tile = geo.q_tiles - 1 - tile
    cta_row0 = tile * (CONSUMERS * bq)
    cta_blocks = _key_blocks(geo, cta_row0 + CONSUMERS * bq)

    def placed(x: Any, layout: Any) -> Any:
        """``x`` in register layout ``layout`` (the interpreter has no layouts and no lowering for the cast)."""
        return x if interpreted else plgpu.layout_cast(x, layout)

    def take_turn() -> None:
        plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(turn)

    @pl.when(wg < CONSUMERS)
    def _consumer() -> None:
        plgpu.set_max_registers(_CONSUMER_REGS, action="increase")
        row0 = cta_row0 + wg * bq
        q_tile, lse_tile = qo_smem.at[wg], lse_smem.at[wg]
        blocks = _key_blocks(geo, row0 + bq)
        unmasked = _unmasked_blocks(geo, row0, blocks)

        plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(row0, bq), head], q_tile, q_ready.at[wg])
        plgpu.barrier_wait(q_ready.at[wg])

        m = placed(jnp.full((bq,), _M_INIT, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        total = placed(jnp.full((bq,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc = placed(jnp.full((bq, d), 0.0, jnp.float32), plgpu.Layout.WGMMA)

        _when(blocks > 0, lambda: plgpu.barrier_wait(k_ready.at[0]))

        # Consumer 1 starts half a step behind consumer 0 (their matrix products alternate).
        pl.when(wg == 1)(take_turn)
        c = geo.scale * _LOG2E  # scores -> base-2 exponents, folded into one multiply-add

        def step(n: Any, carry: Any, masked: bool) -> Any:
            acc, m, total = carry
            slot = lax.rem(n, stages)

            def scores(s_ref: Any) -> Any:
                plgpu.wgmma(s_ref, q_tile, k_smem.at[slot].transpose((1, 0)))
                take_turn()
                return s_ref[...]

            if interpreted:  # see the note on interpret mode at the top
                s = jnp.dot(q_tile[...], k_smem.at[slot][...].T, preferred_element_type=jnp.float32)
                take_turn()
            else:
                s = pl.run_scoped(scores, plgpu.ACC((bq, bk), jnp.float32))  # [bq, bk]
            plgpu.barrier_arrive(k_free.at[slot])
            if c <= 0:  # a negative (or zero) scale flips the order: scale first, then take the max
                s, c_ = s * c, 1.0
            else:
                c_ = c
            if masked:
                rows = placed(lax.broadcasted_iota(jnp.int32, (bq, bk), 0), plgpu.Layout.WGMMA) + row0
                keys = placed(lax.broadcasted_iota(jnp.int32, (bq, bk), 1), plgpu.Layout.WGMMA) + n * bk
                keep = keys < geo.s
                if geo.causal:
                    keep = keep & (keys <= rows + geo.offset)
                s = jnp.where(keep, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1) * c_)
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s * c_ - lax.broadcast_in_dim(m_new, (bq, bk), [0]))
            acc = acc * lax.broadcast_in_dim(alpha, (bq, d), [0])
            total = total * alpha
            p_lo = p.astype(dtype)

            def hand_over() -> None:
                plgpu.barrier_arrive(turn)  # softmax done: the other consumer may use the tensor cores
                plgpu.barrier_wait(v_ready.at[slot])
                plgpu.barrier_wait(turn)  # ... and give them back

            if d <= 128:
                total = total + p.sum(axis=1)
                acc, total, m_new, p_lo = lax.optimization_barrier((acc, total, m_new, p_lo))
                hand_over()
            else:  # at D=256 the row sum after the hand-over keeps register pressure down
                hand_over()
                total = total + p.sum(axis=1)

            def wait_next_k() -> None:
                nxt = n + 1

                @pl.when(nxt < blocks)
                def _() -> None:
                    plgpu.barrier_wait(k_ready.at[lax.rem(nxt, stages)])

            def pv(o_ref_: Any) -> None:
                plgpu.wgmma(o_ref_, p_lo, v_smem.at[slot])
                wait_next_k()  # while this wgmma runs

            if interpreted:
                acc = acc + jnp.dot(p_lo, v_smem.at[slot][...], preferred_element_type=jnp.float32)
                wait_next_k()
            else:
                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, total

        carry = (acc, m, total)
        carry = lax.fori_loop(0, unmasked, functools.partial(step, masked=False), carry)
        if geo.causal or geo.s % geo.bk:
            carry = lax.fori_loop(unmasked, blocks, functools.partial(step, masked=True), carry)
        acc, m, total = carry

        if geo.causal:

            def idle(n: Any, _: Any) -> None:
                # Blocks only the other consumer needs: free the slots, keep taking turns.
                slot = lax.rem(n, stages)
                # Waiting for data this consumer will not read costs nothing (the other one needs it) and
                # keeps every barrier's phases observed by every thread that waits on it.
                plgpu.barrier_wait(k_ready.at[slot])
                plgpu.barrier_wait(v_ready.at[slot])
                plgpu.barrier_arrive(k_free.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])
                take_turn()
                take_turn()

            lax.fori_loop(blocks, cta_blocks, idle, None)
        pl.when(wg == 0)(take_turn)

        empty = total == 0.0
        acc = acc / lax.broadcast_in_dim(jnp.where(empty, 1.0, total), (bq, d), [0])
        q_tile[...] = acc.astype(dtype)
        lse_tile[...] = m * _LN2 + jnp.log(total)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_tile, o_ref.at[batch, pl.ds(row0, bq), head])
        plgpu.copy_smem_to_gmem(lse_tile, lse_ref.at[batch, head, pl.ds(row0, bq)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == CONSUMERS)
    def _producer() -> None:
        plgpu.set_max_registers(_PRODUCER_REGS, action="decrease")
        kv_head = lax.div(head, geo.group)

        def fetch(n: Any, slot: Any, wait: bool) -> None:
            rows = (batch, pl.ds(n * bk, bk), kv_head)
            if wait:
                plgpu.barrier_wait(k_free.at[slot])
            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_ready.at[slot])
            if wait:
                plgpu.barrier_wait(v_free.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_ready.at[slot])

        for i in range(min(stages, geo.sp // bk)):  # a block past the keys would not even trace
            _when(i < cta_blocks, functools.partial(fetch, i, i, False))

        @pl.loop(stages, _max(cta_blocks, stages))
        def _(n: Any) -> None:
            fetch(n, lax.rem(n, stages), True)

        # Wait until the consumers are done with the last slots too: no barrier phase goes unobserved.
        @pl.loop(_max(cta_blocks - stages, 0), cta_blocks)
        def _(n: Any) -> None:
            slot = lax.rem(n, stages)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])


def forward(geo: Geometry, q: jax.Array, k: jax.Array, v: jax.Array, interpret: Any = None) -> tuple[Any, Any]:
    """``(out [B, Tp, H, D], lse [B, H, Tp] float32)`` for padded inputs (see the module docstring)."""
    b, tp, h, d = q.shape
    dtype = jnp.dtype(geo.dtype)
    # 128-byte swizzle on 64-element (128-byte) column tiles: the wgmma operand layout for 16-bit types.
    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    scratch: list[Any] = [
        plgpu.SMEM((CONSUMERS, BLOCK_Q, d), dtype, transforms=transforms),  # Q, then O
        plgpu.SMEM((geo.stages, geo.bk, d), dtype, transforms=transforms),  # K ring
        plgpu.SMEM((geo.stages, geo.bk, d), dtype, transforms=transforms),  # V ring
        plgpu.SMEM((CONSUMERS, BLOCK_Q), jnp.float32),  # lse
        plgpu.Barrier(num_barriers=CONSUMERS),  # Q landed
        plgpu.Barrier(num_barriers=geo.stages),  # K slot landed
        plgpu.Barrier(num_barriers=geo.stages),  # V slot landed
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=geo.stages),  # K slot free
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=geo.stages),  # V slot free
        plgpu.Barrier(num_arrivals=CONSUMERS),  # turns on the tensor cores
    ]
    kwargs: dict[str, Any] = {}
    if interpret is not None:
        kwargs["interpret"] = interpret
    out, lse = plgpu.kernel(
        functools.partial(_forward_body, geo, interpret is not None),
        out_type=(jax.ShapeDtypeStruct((b, tp, h, d), dtype), jax.ShapeDtypeStruct((b, h, tp), jnp.float32)),
        scratch_types=scratch,
        grid=(h, geo.q_tiles, b),
        grid_names=("heads", "q_tiles", "batch"),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **kwargs,
    )(q, k, v)
    return out, lse


def backward(
    geo: Geometry,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    out: jax.Array,
    lse: jax.Array,
    do: jax.Array,
    block: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """dq, dk, dv for unpadded ``[B, T, H, D]`` / ``[B, S, K, D]`` inputs, from ``lse [B, H, T]`` (natural log).

    Plain ``jax.numpy``: a scan over key blocks of ``block`` keys, each recomputing its [T, block]
    probabilities from the saved lse (O(T * block) memory, never [T, S]). dK/dV are formed per query
    head and summed over each GQA group.
    """
    b, t, h, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    group = h // kh
    f32 = jnp.float32
    nblk = -(-s // block)
    sp = nblk * block
    qf = q.astype(f32)
    dof = do.astype(f32)
    delta = jnp.einsum("bthd,bthd->bht", dof, out.astype(f32))  # [B, H, T]
    # kv heads repeated per query head, padded to whole blocks, blocks leading: [N, B, block, H, D]
    kf = jnp.pad(jnp.repeat(k, group, axis=2).astype(f32), ((0, 0), (0, sp - s), (0, 0), (0, 0)))
    vf = jnp.pad(jnp.repeat(v, group, axis=2).astype(f32), ((0, 0), (0, sp - s), (0, 0), (0, 0)))
    kb = kf.reshape(b, nblk, block, h, d).transpose(1, 0, 2, 3, 4)
    vb = vf.reshape(b, nblk, block, h, d).transpose(1, 0, 2, 3, 4)
    rows = jnp.arange(t)[:, None]
    live = jnp.isfinite(lse)[..., None]  # rows that admit some key
    lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]

    def one_block(dq: Any, xs: Any) -> Any:
        n, kj, vj = xs
        keys = n * block + jnp.arange(block)[None, :]
        keep = keys < s
        if geo.causal:
            keep = keep & (keys <= rows + (s - t))
        sc = jnp.einsum("bthd,bshd->bhts", qf, kj) * geo.scale
        p = jnp.where(keep & live, jnp.exp(sc - lse_safe), 0.0)  # [B, H, T, block]
        dv = jnp.einsum("bhts,bthd->bshd", p, dof)
        dp = jnp.einsum("bthd,bshd->bhts", dof, vj)
        ds = p * (dp - delta[..., None]) * geo.scale
        dq = dq + jnp.einsum("bhts,bshd->bthd", ds, kj)
        dk = jnp.einsum("bhts,bthd->bshd", ds, qf)
        return dq, (dk, dv)

    dq, (dk, dv) = lax.scan(one_block, jnp.zeros((b, t, h, d), f32), (jnp.arange(nblk), kb, vb))
    dk = dk.transpose(1, 0, 2, 3, 4).reshape(b, sp, kh, group, d)[:, :s].sum(3)
    dv = dv.transpose(1, 0, 2, 3, 4).reshape(b, sp, kh, group, d)[:, :s].sum(3)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
