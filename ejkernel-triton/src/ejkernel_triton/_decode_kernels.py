"""The split-K decode kernel (flash-decoding) shared by ``page_attention`` and ``ragged_decode_attention``.

One program per (split, kv head, sequence): it holds the ``G = H // KH`` query heads of its kv head as
the rows of one tile (GQA/MQA packing: each key and value is read once for all of them, and the rows are
padded to ``BLOCK_H >= 16`` so the dots run on the tensor cores), walks the key blocks of its split of the
sequence's interval ``[lo, hi)`` with an online softmax in float32, and writes its partial output,
normalized, with its log-sum-exp. ``ejkernel_triton._decode.merge_splits`` merges the splits.

Layouts (C-contiguous, built by ``ejkernel_triton._decode``):

* ``q [N, H, D]``; the caches as rows of tokens, ``k [R, KH, D]``, ``v [R, KH, DV]``: a paged cache's
  ``[P, page, KH, D]`` is ``R = P * page`` rows (token ``j`` of sequence ``n`` is row
  ``tables[n, j // PAGE] * PAGE + j % PAGE``), a dense ``[N, S, KH, D]`` one ``R = N * S`` (row ``n * S + j``);
* ``lo``/``hi [N]`` int32: the keys sequence ``n`` attends, already clamped into the cache (and the window
  applied) by the launcher; ``tables [N, M]`` int32 (paged only; entries are clamped into ``[0, P)`` here);
* outputs ``o [N, NUM_SPLITS, H, DV]`` float32 (zeros for a split that saw no key) and
  ``lse [N, NUM_SPLITS, H]`` float32 (natural-log units, ``-inf`` for such a split).

Tokens outside ``[lo, hi)`` are never loaded (masked loads), so cache contents there (NaN included) and
table entries past the sequence's pages never matter, and no address leaves the cache.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ejkernel_triton.language import LN2, LOG2E, mma, online_softmax_step, tanh  # the interpreter switch first


@triton.jit
def _token_rows(Tables, i_n64, tokens, ok, M, S, P, PAGE: tl.constexpr, PAGED: tl.constexpr):
    """Rows of the flattened cache that hold ``tokens`` of sequence ``i_n64`` (int64; 0 where not ``ok``)."""
    if PAGED:
        # one table entry per token: the entries of a block's few pages are the same few cache lines
        b_page = tl.load(Tables + i_n64 * M + tokens // PAGE, mask=ok, other=0)
        b_page = tl.minimum(tl.maximum(b_page, 0), P - 1)  # never outside the cache (contract: clamped)
        rows = b_page.to(tl.int64) * PAGE + (tokens % PAGE)
    else:
        rows = i_n64 * S + tl.where(ok, tokens, 0)
    return rows


@triton.jit
def split_kv_decode(
    Q,
    K,
    V,
    Lo,
    Hi,
    Tables,
    sm_scale,
    softcap,
    M,
    S,
    P,
    O,
    Lse,
    H: tl.constexpr,
    KH: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    PAGED: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    G: tl.constexpr = H // KH
    i_s = tl.program_id(0)
    i_kh = tl.program_id(1)
    i_n = tl.program_id(2)
    i_n64 = i_n.to(tl.int64)
    lo = tl.load(Lo + i_n)
    hi = tl.load(Hi + i_n)

    # This split's key blocks: the blocks of BLOCK_N absolute positions that meet [lo, hi), dealt out in
    # equal runs (block-aligned, so that a block covers whole pages when BLOCK_N is a multiple of PAGE).
    first = lo // BLOCK_N
    n_blocks = tl.maximum(tl.cdiv(hi, BLOCK_N) - first, 0)
    per_split = tl.cdiv(n_blocks, NUM_SPLITS)
    k_start = (first + i_s * per_split) * BLOCK_N
    k_stop = tl.minimum(k_start + per_split * BLOCK_N, hi)

    heads = tl.arange(0, BLOCK_H)
    h_ok = heads < G
    rows_q = i_kh * G + heads  # the query heads of kv head i_kh
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    p_q = Q + i_n64 * (H * D) + rows_q[:, None] * D + offs_d[None, :]
    b_q = tl.load(p_q, mask=h_ok[:, None] & (offs_d < D)[None, :], other=0.0)  # [BH, BD]

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for start in range(k_start, k_stop, BLOCK_N):
        tokens = start + tl.arange(0, BLOCK_N)
        ok = (tokens >= lo) & (tokens < k_stop)
        rows = _token_rows(Tables, i_n64, tokens, ok, M, S, P, PAGE, PAGED)  # [BN] int64
        p_k = K + rows[:, None] * (KH * D) + i_kh * D + offs_d[None, :]
        b_k = tl.load(p_k, mask=ok[:, None] & (offs_d < D)[None, :], other=0.0).to(b_q.dtype)  # [BN, BD]; float8 too
        p_v = V + rows[:, None] * (KH * DV) + i_kh * DV + offs_dv[None, :]
        b_v = tl.load(p_v, mask=ok[:, None] & (offs_dv < DV)[None, :], other=0.0).to(b_q.dtype)  # [BN, BDV]
        b_qk = mma(b_q, tl.trans(b_k), tl.zeros([BLOCK_H, BLOCK_N], tl.float32))  # [BH, BN]
        if HAS_SOFTCAP:
            b_s = softcap * tanh(b_qk * sm_scale / softcap) * LOG2E
        else:
            b_s = b_qk * (sm_scale * LOG2E)
        b_s = tl.where(ok[None, :], b_s, float("-inf"))
        b_p, m_i, l_i, acc = online_softmax_step(b_s, m_i, l_i, acc)
        acc = mma(b_p.to(b_v.dtype), b_v, acc)  # [BH, BDV]

    seen = l_i > 0.0
    b_o = acc / tl.where(seen, l_i, 1.0)[:, None]
    b_lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    out_rows = (i_n64 * NUM_SPLITS + i_s) * H + rows_q  # [BH] rows of o [N * NUM_SPLITS * H, DV]
    p_o = O + out_rows[:, None] * DV + offs_dv[None, :]
    tl.store(p_o, b_o, mask=h_ok[:, None] & (offs_dv < DV)[None, :])
    tl.store(Lse + out_rows, b_lse, mask=h_ok)
