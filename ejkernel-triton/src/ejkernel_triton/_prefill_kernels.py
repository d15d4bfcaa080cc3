"""The prefill kernel of ``ragged_page_attention``: flash-style query tiles over a paged cache.

One program per (query tile, kv head). A tile is ``BLOCK_Q = BLOCK_M // G`` consecutive query rows of ONE
sequence (tiles never straddle sequences) times the ``G = H // KH`` query heads of the kv head, packed into the
``BLOCK_M`` rows of one tile (row ``m`` is query row ``m // G``, head ``m % G``: every key and value block is
read once for all ``G`` heads, like the split-K decode kernel's GQA packing). The program walks the key blocks
of ``BLOCK_N`` tokens, gathered through the sequence's block table (one table entry per token, clamped into
``[0, P)``), with an online softmax in float32 (log2 units), and writes its rows, normalized, in the output's
dtype.

Causal, bottom-right aligned: row ``r`` of a sequence of ``q_len`` queries over ``kv_len`` keys sits at position
``i = kv_len - q_len + r`` and attends the keys ``[lo, hi)``, ``hi = min(i + 1, capacity)`` and ``lo = max(hi -
window, 0)`` (0 without a window). Rows of a tile have consecutive positions, so the tile visits the key blocks
``[lo of its first row, hi of its last row)``: blocks past the last row's position (causal block skipping) and
before the first row's window are never read. The blocks every row admits whole run without masks; the others
(the window's edge, the causal diagonal, a ragged end) mask per element, as the flash forward does
(``ejkernel_triton.language.span``).

Layouts (C-contiguous, built by ``ejkernel_triton.ragged_page_attention.interface``):

* ``q [T, H, D]``; the caches as rows of tokens, ``k [P * PAGE, KH, D]``, ``v [P * PAGE, KH, DV]`` (token ``j`` of
  a sequence is row ``tables[seq, j // PAGE] * PAGE + j % PAGE``); ``tables [S, M]`` int32;
* ``tiles [NT, 4]`` int32: per tile (its sequence, its first row in ``q``, its number of rows -- 0 for the
  programs past the real tile count, which exit at once --, the position of its first row);
* output ``o [T, H, DV]`` in ``q``'s dtype: only the rows of the tiles are written.

Keys at or past the last row's ``hi`` are never loaded (masked loads): cache contents there (NaN included) and
table entries past the sequence's pages never matter, and no address leaves the cache.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ejkernel_triton.language import LOG2E, mma, online_softmax_step, span, tanh  # the interpreter switch first


@triton.jit
def _prefill_blocks(
    acc,
    l_i,
    m_i,
    b_q,
    lo,
    hi,
    table,
    k_base,
    v_base,
    sm_scale,
    softcap,
    P,
    n_lo,
    n_hi,
    end,
    KH: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """The key blocks ``[n_lo, n_hi)`` of one tile: scores, online softmax, ``P @ V``. ``MASKED``: blocks that
    some row admits only in part, or that reach past ``end`` (the keys past it are never loaded)."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start in range(n_lo, n_hi, BLOCK_N):
        tokens = start + tl.arange(0, BLOCK_N)  # [BN]
        if MASKED:
            t_ok = tokens < end
            b_page = tl.load(table + tokens // PAGE, mask=t_ok, other=0)
        else:
            b_page = tl.load(table + tokens // PAGE)
        b_page = tl.minimum(tl.maximum(b_page, 0), P - 1)  # never outside the cache (contract: clamped)
        rows = b_page.to(tl.int64) * PAGE + (tokens % PAGE)  # [BN] rows of the flattened cache
        p_k = k_base + rows[:, None] * (KH * D) + offs_d[None, :]
        p_v = v_base + rows[:, None] * (KH * DV) + offs_dv[None, :]
        if MASKED:
            if D == BLOCK_D:
                b_k = tl.load(p_k, mask=t_ok[:, None], other=0.0)
            else:
                b_k = tl.load(p_k, mask=t_ok[:, None] & (offs_d < D)[None, :], other=0.0)
        else:
            if D == BLOCK_D:
                b_k = tl.load(p_k)
            else:
                b_k = tl.load(p_k, mask=(offs_d < D)[None, :], other=0.0)
        b_k = b_k.to(b_q.dtype)  # a float8 cache: converted in registers
        b_qk = mma(b_q, tl.trans(b_k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32))  # [BM, BN]
        if HAS_SOFTCAP:
            b_s = softcap * tanh(b_qk * sm_scale / softcap) * LOG2E
        else:
            b_s = b_qk * (sm_scale * LOG2E)
        if MASKED:
            jj = tokens[None, :]
            b_s = tl.where((jj >= lo[:, None]) & (jj < hi[:, None]), b_s, float("-inf"))
        b_p, m_i, l_i, acc = online_softmax_step(b_s, m_i, l_i, acc)
        if MASKED:
            if DV == BLOCK_DV:
                b_v = tl.load(p_v, mask=t_ok[:, None], other=0.0)
            else:
                b_v = tl.load(p_v, mask=t_ok[:, None] & (offs_dv < DV)[None, :], other=0.0)
        else:
            if DV == BLOCK_DV:
                b_v = tl.load(p_v)
            else:
                b_v = tl.load(p_v, mask=(offs_dv < DV)[None, :], other=0.0)
        acc = mma(b_p.to(b_q.dtype), b_v.to(b_q.dtype), acc)  # [BM, BDV]
    return acc, l_i, m_i


@triton.jit
def ragged_prefill(
    Q,
    K,
    V,
    Tiles,
    Tables,
    sm_scale,
    softcap,
    window,
    M,
    P,
    capacity,
    O,
    H: tl.constexpr,
    KH: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """One program: one query tile (``BLOCK_M // G`` rows x ``G`` heads) of one kv head. Grid ``(NT, KH)``."""
    G: tl.constexpr = H // KH
    BLOCK_Q: tl.constexpr = BLOCK_M // G
    i_t = tl.program_id(0)
    i_kh = tl.program_id(1)
    tile = Tiles + i_t * 4
    n_rows = tl.load(tile + 2)
    if n_rows <= 0:  # past the real tile count
        return
    seq = tl.load(tile)
    row0 = tl.load(tile + 1)
    pos0 = tl.load(tile + 3)

    # The tile's key blocks, from its first and last rows (positions grow with the row).
    hi_first = tl.minimum(tl.maximum(pos0 + 1, 0), capacity)
    end = tl.minimum(tl.maximum(pos0 + n_rows, 0), capacity)  # hi of the last row
    if HAS_WINDOW:
        lo_first = tl.maximum(hi_first - window, 0)
        lo_last = tl.maximum(end - window, 0)
    else:
        lo_first = 0
        lo_last = 0
    start = (lo_first // BLOCK_N) * BLOCK_N
    full_lo = tl.minimum(tl.maximum(tl.cdiv(lo_last, BLOCK_N) * BLOCK_N, start), end)
    full_hi = tl.minimum(tl.maximum((hi_first // BLOCK_N) * BLOCK_N, full_lo), end)

    # The packed rows: query row m // G, head m % G of kv head i_kh.
    offs_m = tl.arange(0, BLOCK_M)
    tq = offs_m // G
    m_ok = (offs_m < BLOCK_Q * G) & (tq < n_rows)
    q_rows = (row0 + tq).to(tl.int64) * H + (i_kh * G + offs_m % G)  # [BM] rows of q [T * H, D]
    pos = pos0 + tq
    hi = tl.minimum(tl.maximum(pos + 1, 0), capacity)  # [BM]
    if HAS_WINDOW:
        lo = tl.maximum(hi - window, 0)
    else:
        lo = tl.zeros([BLOCK_M], tl.int32)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    p_q = Q + q_rows[:, None] * D + offs_d[None, :]
    if D == BLOCK_D:
        b_q = tl.load(p_q, mask=m_ok[:, None], other=0.0)  # [BM, BD]
    else:
        b_q = tl.load(p_q, mask=m_ok[:, None] & (offs_d < D)[None, :], other=0.0)

    table = Tables + seq.to(tl.int64) * M
    k_base = K + i_kh * D
    v_base = V + i_kh * DV
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    # Blocks the window's edge cuts, then those every row admits whole, then the causal diagonal.
    for PART in tl.static_range(3):
        n_lo, n_hi = span(PART, start, full_lo, full_hi, end)
        acc, l_i, m_i = _prefill_blocks(
            acc,
            l_i,
            m_i,
            b_q,
            lo,
            hi,
            table,
            k_base,
            v_base,
            sm_scale,
            softcap,
            P,
            n_lo,
            n_hi,
            end,
            KH,
            D,
            DV,
            BLOCK_D,
            BLOCK_DV,
            BLOCK_M,
            BLOCK_N,
            PAGE,
            PART != 1,
            HAS_SOFTCAP,
        )

    # A row that admitted no key (l_i == 0) gives zeros, never NaN.
    b_o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    p_o = O + q_rows[:, None] * DV + offs_dv[None, :]
    if DV == BLOCK_DV:
        tl.store(p_o, b_o.to(O.dtype.element_ty), mask=m_ok[:, None])
    else:
        tl.store(p_o, b_o.to(O.dtype.element_ty), mask=m_ok[:, None] & (offs_dv < DV)[None, :])
