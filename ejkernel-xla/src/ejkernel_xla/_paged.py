"""Blockwise attention over key/value caches in plain JAX: the machinery of the three serving ops.

Work items. ``page_attention`` and ``ragged_page_attention`` reduce to one problem: ``I`` items, each
``R`` query rows of one sequence, with that sequence's page table, its kv length and the absolute
position of every row (``-1``: a padding row). The row at position ``i`` admits the keys ``j`` with
``j <= i``, ``j < kv_len`` and, with a window ``W``, ``j > i - W``. A decode query is an item of one row
at position ``L - 1``; a prefill chunk is an item of ``R`` consecutive rows.

Loop. Items are processed ``C`` at a time (a chunk; a ``lax.map`` over chunks, items sorted by how far
they read so that a chunk's items need similar numbers of blocks). For a chunk, a ``lax.fori_loop``
runs over the key blocks it needs, and only those (the bounds are dynamic: blocks past the longest
length, or before every window, cost nothing). One block is ``ppb`` pages (``bk = ppb * page`` tokens)
of every item of the chunk, gathered through the page tables (``key_cache[tables[:, b*ppb:(b+1)*ppb]]``):
the cache is never copied whole. Scores and an online softmax (running max ``m``, running sum ``l``,
accumulator) are in float32. Stale cache contents (NaN included) never leak: scores at positions that are not
keys are masked, and values there are zeroed before they are summed (a probability of 0 times NaN is NaN) in the
blocks past the shortest key length of a chunk's items; the blocks before it hold keys only, and skip that
(it costs a read and a write of the value block: ~10% of a decode step on an H200). A row that admitted no key
gives zeros whatever its accumulator holds.

``ragged_decode_attention`` runs the same online softmax over blocks of a dense ``[B, S, K, D]`` cache,
``C`` batch rows at a time, from the first block any of them needs to the last (``dynamic_slice``s, no copy).

Layout in the loop: queries ``[C, K, G, R, D]`` (``G = H // K`` query heads per kv head: GQA/MQA need no
repeat of keys), key/value blocks ``[C, bk, K, D]`` as gathered, score tiles ``[C, K, G, R, bk]``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32
NEG_INF = -jnp.inf
BIG = jnp.iinfo(jnp.int32).max

MIN_CHUNK = 8  # shrink the key block rather than process fewer items than this at a time


@dataclasses.dataclass(frozen=True)
class Budget:
    """How large one loop step may be: a gathered key block of ``C * bk * K * max(D, Dv)`` elements, a score tile
    of ``C * H * R * bk`` elements, and the key block's starting size in tokens; ``grow``: whether the key block
    may grow past that when every item fits one chunk."""

    kv_elements: int
    tile_elements: int
    kv_tokens: int
    grow: bool = False


# Measured on a 2-core CPU: blocks and tiles of about 2**20 elements (4 MiB in float32) were within ~10% of the best.
CPU_BUDGET = Budget(1 << 20, 1 << 20, 512)
# On a GPU or TPU each loop step is a launch (and a gather) of its own, and small steps leave the device idle:
# few large steps (64 sequences x 2048 keys of 8 x 128 per step at the serving issue's shape). Not yet timed on a
# GPU: the autotuner's candidates surround it.
# Growing the block for few items (one long sequence: 16 steps of 2048 keys became one) is for accelerators only:
# the CPU keeps the measured block size (and the CPU tier its multi-block loops).
ACCELERATOR_BUDGET = Budget(1 << 27, 1 << 27, 2048, grow=True)


def on_cpu(backend: str | None) -> bool:
    """Whether ``backend`` (``"cpu"``, ``"gpu"``, ``"tpu"``; None: JAX's default backend) is the CPU, whose loops
    take small steps; an accelerator's take few large ones."""
    return (backend or jax.default_backend()) == "cpu"


def budget_for(backend: str | None) -> Budget:
    """The step budget of a backend (``"cpu"``, ``"gpu"``, ``"tpu"``; None: JAX's default backend)."""
    return CPU_BUDGET if on_cpu(backend) else ACCELERATOR_BUDGET


@dataclasses.dataclass(frozen=True)
class Options:
    """Static options of one call."""

    scale: float
    soft_cap: float | None = None
    window: int | None = None


def options(head_dim: int, softmax_scale: Any, logits_soft_cap: Any, sliding_window: Any) -> Options:
    return Options(
        scale=float(head_dim**-0.5 if softmax_scale is None else softmax_scale),
        soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        window=None if sliding_window is None else int(sliding_window),
    )


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def balanced(chunk: int, n: int) -> int:
    """The chunk size used for ``n`` items: at most ``chunk``, as even as the same number of chunks allows."""
    chunk = max(1, min(int(chunk), n))
    return cdiv(n, cdiv(n, chunk))


def chunk_for(bk: int, items: int, rows: int, h: int, kh: int, e: int, budget: Budget = CPU_BUDGET) -> int:
    """Items per chunk for key blocks of ``bk`` tokens: as many as the budget allows (at least one),
    balanced over ``items``."""
    most = min(budget.kv_elements // (bk * kh * e), budget.tile_elements // (bk * h * rows))
    return balanced(max(1, most), max(items, 1))


def choose_blocks(
    items: int, rows: int, h: int, kh: int, e: int, kv_max: int, granule: int, budget: Budget = CPU_BUDGET
) -> tuple[int, int]:
    """Heuristic ``(bk, C)``: key block tokens (a multiple of ``granule``, the page size) and items per chunk.

    ``items`` items of ``rows`` query rows, ``h``/``kh`` query/kv heads, head dim ``e`` (the larger of
    D and Dv), at most ``kv_max`` keys per item. The key block starts at ``budget.kv_tokens`` (at most
    ``kv_max``) and shrinks, by whole granules, while the budget would leave fewer than ``MIN_CHUNK``
    items per chunk; or, with ``budget.grow`` and every item in one chunk, doubles while they still fit (few
    sequences, or one kv head: fewer, larger loop steps); ``C`` is then ``chunk_for(bk, ...)``.

    >>> choose_blocks(64, 1, 32, 8, 128, 4096, 16)  # the serving issue's decode shape on a CPU
    (128, 8)
    >>> choose_blocks(64, 1, 32, 8, 128, 4096, 16, ACCELERATOR_BUDGET)  # and on a GPU: two steps of 2048 keys
    (2048, 64)
    >>> choose_blocks(1, 1, 32, 8, 128, 32768, 16, ACCELERATOR_BUDGET)  # one long sequence: one step
    (32768, 1)
    """
    items = max(items, 1)
    whole = cdiv(max(kv_max, 1), granule) * granule
    bk = min(whole, max(granule, budget.kv_tokens // granule * granule))
    while chunk_for(bk, MIN_CHUNK, rows, h, kh, e, budget) < min(MIN_CHUNK, items) and bk > granule:
        bk = max(granule, bk // 2 // granule * granule)
    while budget.grow and bk < whole and chunk_for(min(whole, 2 * bk), items, rows, h, kh, e, budget) >= items:
        bk = min(whole, 2 * bk)
    return bk, chunk_for(bk, items, rows, h, kh, e, budget)


# Around the heuristic (key block, chunk): these factors, clipped and rounded, duplicates dropped.
_CANDIDATE_FACTORS = ((1, 1), (2, 1), (0.5, 1), (1, 2), (1, 0.5), (2, 0.5), (0.5, 2))


def candidate_blocks(bk: int, c: int, items: int, kv_max: int, granule: int) -> list[tuple[int, int]]:
    """``(bk, C)`` pairs near the heuristic's for the autotuner: ``bk`` whole granules up to the longest
    length, ``C`` in ``[1, items]``."""
    whole = cdiv(max(kv_max, 1), granule) * granule
    out: list[tuple[int, int]] = []
    for fk, fc in _CANDIDATE_FACTORS:
        pair = (
            min(whole, max(granule, int(bk * fk) // granule * granule)),
            balanced(max(1, int(c * fc)), max(items, 1)),
        )
        if pair not in out:
            out.append(pair)
    return out


# ---- online softmax -----------------------------------------------------------------------------


def init_state(rows: tuple[int, ...], dv: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(m, l, acc)`` for score rows of shape ``rows``: nothing seen yet."""
    return jnp.full(rows, NEG_INF, F32), jnp.zeros(rows, F32), jnp.zeros((*rows, dv), F32)


def update(o: Options, state: Any, q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array,
           key_ok: jax.Array | None) -> Any:  # fmt: skip
    """Fold one key block into the state.

    ``q [C, K, G, R, D]``, ``k [C, bk, K, D]``, ``v [C, bk, K, Dv]``; ``allowed [C, R, bk]``: which keys each
    row admits; ``key_ok [C, bk]``: which positions hold keys at all (the values elsewhere are zeroed), or None
    where every position of the block holds a key for every item whose rows may admit one.
    """
    m, l, acc = state
    k, v = k.astype(q.dtype), v.astype(q.dtype)  # a float8 cache: its block in the query's dtype
    s = jnp.einsum("ckgrd,cskd->ckgrs", q, k, preferred_element_type=F32) * F32(o.scale)
    if o.soft_cap is not None:
        s = F32(o.soft_cap) * jnp.tanh(s / F32(o.soft_cap))
    s = jnp.where(allowed[:, None, None], s, NEG_INF)
    m_new = jnp.maximum(m, s.max(axis=-1))
    m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)  # nothing admitted yet: p = 0 below
    p = jnp.exp(s - m_safe[..., None])
    alpha = jnp.exp(m - m_safe)
    if key_ok is not None:
        v = jnp.where(key_ok[:, :, None, None], v, jnp.zeros((), v.dtype))
    pv = jnp.einsum("ckgrs,cskd->ckgrd", p.astype(v.dtype), v, preferred_element_type=F32)
    return m_new, alpha * l + p.sum(axis=-1), acc * alpha[..., None] + pv


def finish(state: Any, dtype: Any) -> jax.Array:
    """``acc / l`` as ``[C, K, G, R, Dv]`` in ``dtype``; rows that admitted no key (``l == 0``) give zeros (their
    accumulator may hold NaN from stale values that were not zeroed). A NaN sum (a NaN query or admitted key)
    stays NaN, as in the reference: it must not read as "no key"."""
    _, l, acc = state
    empty = l == 0
    return jnp.where(empty[..., None], 0.0, acc / jnp.where(empty, 1.0, l)[..., None]).astype(dtype)


def heads_last(x: jax.Array) -> jax.Array:
    """``[C, K, G, R, E]`` -> ``[C, R, K * G, E]``."""
    c, kh, g, r, e = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(c, r, kh * g, e)


def heads_grouped(q: jax.Array, kh: int) -> jax.Array:
    """``[C, R, H, D]`` -> ``[C, K, G, R, D]``."""
    c, r, h, d = q.shape
    return q.reshape(c, r, kh, h // kh, d).transpose(0, 2, 3, 1, 4)


# ---- paged items ----------------------------------------------------------------------------------


def paged_items(o: Options, q: jax.Array, key_cache: jax.Array, value_cache: jax.Array, tables: jax.Array,
                kv_len: jax.Array, q_pos: jax.Array, *, kv_tokens: int, chunk: int) -> jax.Array:  # fmt: skip
    """Attention of ``I`` items over a paged cache; returns ``[I, R, H, Dv]`` in ``q.dtype``.

    ``q [I, R, H, D]``; ``key_cache [P, page, K, D]``, ``value_cache [P, page, K, Dv]``; ``tables [I, M]``
    page indices; ``kv_len [I]``; ``q_pos [I, R]`` absolute position of every row, ``-1`` for padding
    rows. ``kv_tokens``: key block, rounded down to whole pages (at least one); ``chunk``: items at a time.
    """
    # NumPy caches arrive as NumPy, and NumPy cannot be indexed with the traced page indices below.
    q, key_cache, value_cache = jnp.asarray(q), jnp.asarray(key_cache), jnp.asarray(value_cache)
    n_items, r, h, d = q.shape
    num_pages, page, kh, _ = key_cache.shape
    dv = value_cache.shape[-1]
    m = tables.shape[1]
    ppb = max(1, min(m, int(kv_tokens) // page))
    bk = ppb * page
    nb = cdiv(m, ppb)
    tables = jnp.clip(tables.astype(jnp.int32), 0, num_pages - 1)  # unused entries may hold anything
    if nb * ppb > m:
        tables = jnp.pad(tables, ((0, 0), (0, nb * ppb - m)))
    kv_len = kv_len.astype(jnp.int32)
    q_pos = q_pos.astype(jnp.int32)

    c = balanced(chunk, n_items)
    n_chunks = cdiv(n_items, c)
    padded = n_chunks * c
    if n_chunks > 1:
        # Sort items by how far they read, so that each chunk's loop stops near its own longest item.
        reach = jnp.where(q_pos >= 0, jnp.minimum(q_pos + 1, kv_len[:, None]), 0).max(axis=1)
        order = jnp.concatenate([jnp.argsort(-reach, stable=True), jnp.arange(n_items, padded)]).astype(jnp.int32)
        real = order < n_items
        src = jnp.minimum(order, n_items - 1)
        q, tables = q[src], tables[src]
        kv_len = jnp.where(real, kv_len[src], 0)
        q_pos = jnp.where(real[:, None], q_pos[src], -1)

    def one_chunk(x: Any) -> jax.Array:
        qc, tc, kvc, posc = x  # [C, R, H, D], [C, nb * ppb], [C], [C, R]
        qg = heads_grouped(qc, kh)
        valid = posc >= 0
        hi = jnp.where(valid, jnp.minimum(posc + 1, kvc[:, None]), 0).max()
        blk_hi = jnp.clip((hi + bk - 1) // bk, 0, nb)
        if o.window is None:
            blk_lo = jnp.zeros((), jnp.int32)
        else:
            lo = jnp.where(valid, jnp.maximum(posc - o.window + 1, 0), BIG).min()
            blk_lo = jnp.minimum(lo // bk, blk_hi)

        # Blocks before blk_full hold keys only for every item with a row that may admit one (the others give
        # zeros): their values need no zeroing.
        blk_full = jnp.clip(jnp.where(valid.any(axis=1), kvc, BIG).min() // bk, blk_lo, blk_hi)

        def block(b: Any, state: Any, mask_values: bool) -> Any:
            cols = lax.dynamic_slice_in_dim(tc, b * ppb, ppb, axis=1)  # [C, ppb]
            kb = key_cache[cols].reshape(c, bk, kh, d)
            vb = value_cache[cols].reshape(c, bk, kh, dv)
            j = b * bk + jnp.arange(bk, dtype=jnp.int32)
            key_ok = j[None, :] < kvc[:, None]  # [C, bk]
            allowed = (j[None, None, :] <= posc[:, :, None]) & key_ok[:, None, :]  # [C, R, bk]
            if o.window is not None:
                allowed &= j[None, None, :] > posc[:, :, None] - o.window
            return update(o, state, qg, kb, vb, allowed, key_ok if mask_values else None)

        state = init_state((c, kh, h // kh, r), dv)
        state = lax.fori_loop(blk_lo, blk_full, lambda b, st: block(b, st, False), state)
        state = lax.fori_loop(blk_full, blk_hi, lambda b, st: block(b, st, True), state)
        return heads_last(finish(state, q.dtype))

    if n_chunks == 1:  # then c == n_items: nothing was padded or sorted
        return one_chunk((q, tables, kv_len, q_pos))
    pieces = (q, tables, kv_len, q_pos)  # sorted and padded to n_chunks * c items above
    out = lax.map(one_chunk, tuple(x.reshape(n_chunks, c, *x.shape[1:]) for x in pieces))
    return out.reshape(padded, r, h, dv)[jnp.argsort(order)[:n_items]]


# ---- dense ragged decode ----------------------------------------------------------------------------


def ragged_dense(o: Options, q: jax.Array, key: jax.Array, value: jax.Array, start: jax.Array, end: jax.Array,
                 *, kv_tokens: int, chunk: int) -> jax.Array:  # fmt: skip
    """Decode attention over a dense cache with per-row valid ranges; returns ``[B, H, Dv]`` in ``q.dtype``.

    ``q [B, H, D]``, ``key [B, S, K, D]``, ``value [B, S, K, Dv]``; row ``b`` reads ``[start[b], end[b])``
    (clipped to ``[0, S]``). ``kv_tokens``: key block (at most S); ``chunk``: batch rows at a time.
    """
    b, h, d = q.shape
    s, kh = key.shape[1], key.shape[2]
    dv = value.shape[-1]
    bk = max(1, min(int(kv_tokens), s))
    nkb = cdiv(s, bk)
    hi = jnp.clip(end.astype(jnp.int32), 0, s)
    lo = jnp.clip(start.astype(jnp.int32), 0, s)
    if o.window is not None:
        lo = jnp.maximum(lo, hi - o.window)  # the query sits at position hi - 1
    c = balanced(chunk, b)
    n_chunks = cdiv(b, c)
    firsts = jnp.minimum(jnp.arange(n_chunks, dtype=jnp.int32) * c, b - c)  # the last chunk may overlap

    def one_chunk(b0: Any) -> jax.Array:
        qg = heads_grouped(lax.dynamic_slice_in_dim(q, b0, c)[:, None], kh)  # [C, K, G, 1, D]
        loc, hic = lax.dynamic_slice_in_dim(lo, b0, c), lax.dynamic_slice_in_dim(hi, b0, c)
        some = hic > loc
        blk_hi = (jnp.where(some, hic, 0).max() + bk - 1) // bk
        blk_lo = jnp.minimum(jnp.where(some, loc, BIG).min() // bk, blk_hi)

        def block(kb_i: Any, state: Any) -> Any:
            # The last block is shifted back to end at S (no padded copy of the cache); the keys it
            # shares with the block before were counted there and are masked here.
            s0 = jnp.minimum(kb_i * bk, s - bk)
            kb = lax.dynamic_slice(key, (b0, s0, 0, 0), (c, bk, kh, d))
            vb = lax.dynamic_slice(value, (b0, s0, 0, 0), (c, bk, kh, dv))
            j = s0 + jnp.arange(bk, dtype=jnp.int32)
            key_ok = (j[None, :] >= jnp.maximum(loc, kb_i * bk)[:, None]) & (j[None, :] < hic[:, None])
            return update(o, state, qg, kb, vb, key_ok[:, None, :], key_ok)

        state = lax.fori_loop(blk_lo, jnp.minimum(blk_hi, nkb), block, init_state((c, kh, h // kh, 1), dv))
        return heads_last(finish(state, q.dtype))[:, 0]  # [C, H, Dv]

    if n_chunks == 1:
        return one_chunk(jnp.zeros((), jnp.int32))
    out = lax.map(one_chunk, firsts)  # [n_chunks, C, H, Dv]
    rows = jnp.arange(b, dtype=jnp.int32)
    which = rows // c
    return out[which, rows - firsts[which]]


# ---- ragged batches as items ------------------------------------------------------------------------


def default_rows(t: int, s: int) -> int:
    """Heuristic rows per item for ``t`` query rows over ``s`` sequence slots: a power of two near the
    mean query length (1 for a decode batch, up to 128 for prefill), at most ``t``."""
    r = 1
    while r * 2 <= t / max(s, 1) and r < 128:
        r *= 2
    return max(1, min(r, t))


def ragged_paged(o: Options, q: jax.Array, key_cache: jax.Array, value_cache: jax.Array, kv_lens: jax.Array,
                 block_tables: jax.Array, cu_q_lens: jax.Array, num_seqs: Any, *, rows: int, kv_tokens: int,
                 chunk: int) -> jax.Array:  # fmt: skip
    """``ragged_page_attention`` as ``paged_items``: every live sequence's query rows cut into items of
    ``rows`` rows. Returns ``[T, H, Dv]`` in ``q.dtype``, zeros on rows no live sequence owns.

    Item ``i`` is chunk ``i - first[s]`` of the sequence ``s`` with ``first[s] <= i < first[s + 1]``; there
    are at most ``min(T, (T + S * (rows - 1)) // rows)`` of them (each sequence adds one partial item).
    """
    q, block_tables = jnp.asarray(q), jnp.asarray(block_tables)  # indexed with tracers below (NumPy cannot be)
    t, h, _ = q.shape
    s = kv_lens.shape[0]
    r = max(1, min(int(rows), t))
    n = jnp.minimum(jnp.asarray(num_seqs, jnp.int32).reshape(-1)[0], s)
    live = jnp.arange(s, dtype=jnp.int32) < n
    cu = cu_q_lens.astype(jnp.int32)
    kv = kv_lens.astype(jnp.int32)
    q_start = cu[:-1]
    q_len = jnp.where(live, jnp.maximum(cu[1:] - q_start, 0), 0)
    per_seq = (q_len + r - 1) // r
    item_end = jnp.cumsum(per_seq).astype(jnp.int32)
    item_first = item_end - per_seq

    n_items = max(1, min(t, (t + s * (r - 1)) // r))
    i = jnp.arange(n_items, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(item_end, i, side="right").astype(jnp.int32), s - 1)
    real = i < item_end[-1]
    k_in_seq = i - item_first[seq]  # which chunk of its sequence
    offset = jnp.arange(r, dtype=jnp.int32)
    row_in_seq = k_in_seq[:, None] * r + offset[None, :]  # [I, R]
    row_ok = real[:, None] & (row_in_seq < q_len[seq][:, None])
    q_pos = jnp.where(row_ok, (kv[seq] - q_len[seq])[:, None] + row_in_seq, -1)
    q_rows = jnp.clip(q_start[seq][:, None] + row_in_seq, 0, t - 1)
    out = paged_items(o, q[q_rows], key_cache, value_cache, block_tables[seq], jnp.where(real, kv[seq], 0), q_pos,
                      kv_tokens=kv_tokens, chunk=chunk)  # fmt: skip

    # Back to rows: row u belongs to the first live sequence whose rows end after u (empty ones never do).
    u = jnp.arange(t, dtype=jnp.int32)
    ends = jnp.where(live, q_start + q_len, BIG)  # non-decreasing over the live sequences, as the contract asks
    owner = jnp.minimum(jnp.searchsorted(ends, u, side="right").astype(jnp.int32), s - 1)
    within = u - q_start[owner]
    owned = live[owner] & (within >= 0) & (within < q_len[owner])
    flat = (item_first[owner] + within // r) * r + within % r
    picked = out.reshape(n_items * r, h, out.shape[-1])[jnp.clip(flat, 0, n_items * r - 1)]
    return jnp.where(owned[:, None, None], picked, jnp.zeros((), picked.dtype))
