"""The split-K decode kernel (flash-decoding) of ``multi_head_latent_attention``.

MLA in absorbed form is MQA with one ``D = DL + DR``-dim latent per key shared by every query head, and the value
is the latent's first ``DL`` dims. So the ``R = T * H`` query rows of one sequence (row ``r``: token ``r // H``,
head ``r % H``) all attend the same keys, and one program takes a block of ``BLOCK_R`` of them against each key
tile, loaded once for the whole block:

* scores ``[BLOCK_R, BLOCK_N]`` as two dots, the latent part (``DL`` dims, e.g. 512) and the rotary part (``DR``,
  e.g. 64): ``D = 576`` is not a power of two, and each part is padded to one on its own. The key tiles are loaded
  already transposed (``[dims, BLOCK_N]``, through the pointers), so no dot result is ever transposed;
* an online softmax in float32 (log2 units), and ``acc [BLOCK_R, BLOCK_DV] += p @ v``. With ``BLOCK_DV`` below
  ``DL`` the value dims are dealt out to several programs, each computing the full scores again but holding only
  its slice of the float32 accumulator (fewer registers for more score work); with one value block the value
  tile is the transpose of the latent tile loaded for the scores (a loaded tile, not a dot result).

The transposed form, ``mla_decode_fwd_t``, is for few rows (a sequence's heads when they are 16 or fewer): a dot's
rows (the wgmma's M, at least 64) are then the keys rather than the query rows, scores ``[BLOCK_N, BLOCK_R] = K Q^T``
(the key tile as loaded, the query tile loaded transposed), the softmax runs down the columns, and ``O^T [DL,
BLOCK_R] += V^T P^T`` (the value is the loaded latent tile transposed; ``P^T`` is the scores' own layout) is stored
through transposed pointers. One value block.

Grid ``(row blocks * value blocks, NUM_SPLITS, B)``: the first axis varies fastest, so the programs that read the
same key tiles run side by side and share them through L2. Each split takes an equal run of the sequence's key
blocks (from its traced length), and writes its normalized partial output with its log-sum-exp;
``ejkernel_triton._decode.merge_splits`` merges the splits.

Layouts (C-contiguous, built by ``ejkernel_triton.multi_head_latent_attention.interface``):

* ``q [B, T, H, D]`` (rows ``[B, R, D]``); the cache as rows of tokens ``[rows, D]``: a paged ``[P, page, D]``
  cache is ``P * PAGE`` rows (token ``j`` of batch ``b`` is row ``tables[b, j // PAGE] * PAGE + j % PAGE``; entries
  are clamped into ``[0, P)`` here), a dense ``[B, S, D]`` one ``B * S`` rows (row ``b * S + j``);
* ``lens [B]`` int32: the keys of each batch, already clamped into the cache by the launcher; ``tables [B, M]``;
* outputs ``o [B, NUM_SPLITS, R, DL]`` float32 (zeros where a split admitted no key) and ``lse [B, NUM_SPLITS, R]``
  float32 (natural-log units, ``-inf`` there).

Causal (bottom-right aligned): row ``r`` admits key ``j`` when ``j <= r // H + L - T``. Tokens at or past the
batch's length are never loaded (masked loads), so no address leaves the cache and table entries past the pages
in use are never read.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ejkernel_triton.language import LN2, LOG2E, mma, online_softmax_step  # the interpreter switch first


@triton.jit
def _token_rows(
    Tables, i_b64, start, tokens, ok, M, S, P, PAGE: tl.constexpr, PAGED: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Rows of the flattened cache that hold ``tokens = start + arange(BLOCK_N)`` of batch ``i_b64`` (int64; a valid
    row where not ``ok``). With pages a multiple of the tile (``start`` is a multiple of ``BLOCK_N``) the tile lies in
    one page: one table entry, and rows the compiler knows to be consecutive (one contiguous block to load)."""
    if PAGED:
        if PAGE % BLOCK_N == 0:
            b_page = tl.load(Tables + i_b64 * M + start // PAGE)  # start < L <= M * PAGE: inside the table
            b_page = tl.minimum(tl.maximum(b_page, 0), P - 1)  # never outside the cache, whatever the table holds
            rows = b_page.to(tl.int64) * PAGE + (start % PAGE) + tl.arange(0, BLOCK_N)
        else:
            b_page = tl.load(Tables + i_b64 * M + tokens // PAGE, mask=ok, other=0)
            b_page = tl.minimum(tl.maximum(b_page, 0), P - 1)
            rows = b_page.to(tl.int64) * PAGE + (tokens % PAGE)
    else:
        rows = i_b64 * S + tl.where(ok, tokens, 0)
    return rows


@triton.jit
def mla_decode_fwd(
    Q,
    KV,
    Lens,
    Tables,
    sm_scale,
    M,
    S,
    P,
    O,
    Lse,
    T: tl.constexpr,
    H: tl.constexpr,
    DL: tl.constexpr,
    DR: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_DL: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    PAGED: tl.constexpr,
    CAUSAL: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    R: tl.constexpr = T * H
    D: tl.constexpr = DL + DR
    N_DV: tl.constexpr = (DL + BLOCK_DV - 1) // BLOCK_DV
    i_rv = tl.program_id(0)
    i_s = tl.program_id(1)
    i_b = tl.program_id(2)
    i_r = i_rv // N_DV
    i_dv = i_rv % N_DV
    i_b64 = i_b.to(tl.int64)
    L = tl.load(Lens + i_b)

    # This split's keys: an equal run of the sequence's BLOCK_N-key blocks; with CAUSAL, none past the last key
    # the block's last row admits.
    n_blocks = tl.cdiv(L, BLOCK_N)
    per_split = tl.cdiv(n_blocks, NUM_SPLITS)
    k_start = i_s * per_split * BLOCK_N
    k_stop = tl.minimum(k_start + per_split * BLOCK_N, L)
    if CAUSAL:
        t_last = tl.minimum(i_r * BLOCK_R + BLOCK_R - 1, R - 1) // H
        k_stop = tl.minimum(k_stop, t_last + L - T + 1)

    rows = i_r * BLOCK_R + tl.arange(0, BLOCK_R)
    m_r = rows < R
    o_l = tl.arange(0, BLOCK_DL)
    m_l = o_l < DL
    o_v = i_dv * BLOCK_DV + tl.arange(0, BLOCK_DV)
    m_v = o_v < DL
    p_q = Q + (i_b64 * R + rows)[:, None] * D
    b_ql = tl.load(p_q + o_l[None, :], mask=m_r[:, None] & m_l[None, :], other=0.0)  # [BR, BDL]
    if DR > 0:
        o_r = tl.arange(0, BLOCK_DR)
        m_rd = o_r < DR
        b_qr = tl.load(p_q + DL + o_r[None, :], mask=m_r[:, None] & m_rd[None, :], other=0.0)  # [BR, BDR]
    if CAUSAL:
        last_key = rows // H + L - T  # [BR]: the last key each row admits

    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    for start in range(k_start, k_stop, BLOCK_N):
        tokens = start + tl.arange(0, BLOCK_N)
        ok = tokens < k_stop
        p_kv = KV + _token_rows(Tables, i_b64, start, tokens, ok, M, S, P, PAGE, PAGED, BLOCK_N) * D  # [BN] row bases
        # the key tiles transposed through the pointers: [dims, BN], the dots' right operands as they are
        b_klt = tl.load(p_kv[None, :] + o_l[:, None], mask=m_l[:, None] & ok[None, :], other=0.0)  # [BDL, BN]
        b_s = mma(b_ql, b_klt, tl.zeros([BLOCK_R, BLOCK_N], tl.float32))  # [BR, BN]
        if DR > 0:
            b_krt = tl.load(p_kv[None, :] + DL + o_r[:, None], mask=m_rd[:, None] & ok[None, :], other=0.0)
            b_s = mma(b_qr, b_krt, b_s)
        b_s = b_s * (sm_scale * LOG2E)
        admitted = ok[None, :]
        if CAUSAL:
            admitted = admitted & (tokens[None, :] <= last_key[:, None])
        b_s = tl.where(admitted, b_s, float("-inf"))
        b_p, m_i, l_i, acc = online_softmax_step(b_s, m_i, l_i, acc)
        if N_DV == 1:
            b_v = tl.trans(b_klt)  # [BN, BDL]: the latent tile already loaded is the value
        else:
            b_v = tl.load(p_kv[:, None] + o_v[None, :], mask=ok[:, None] & m_v[None, :], other=0.0)  # [BN, BDV]
        acc = mma(b_p.to(b_v.dtype), b_v, acc)  # [BR, BDV]

    seen = l_i > 0.0
    b_o = acc / tl.where(seen, l_i, 1.0)[:, None]
    out_rows = (i_b64 * NUM_SPLITS + i_s) * R + rows  # [BR] rows of o [B * NUM_SPLITS * R, DL]
    tl.store(O + out_rows[:, None] * DL + o_v[None, :], b_o, mask=m_r[:, None] & m_v[None, :])
    if i_dv == 0:  # every value block computed the same statistics: one of them writes them
        b_lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
        tl.store(Lse + out_rows, b_lse, mask=m_r)


@triton.jit
def mla_decode_fwd_t(
    Q,
    KV,
    Lens,
    Tables,
    sm_scale,
    M,
    S,
    P,
    O,
    Lse,
    T: tl.constexpr,
    H: tl.constexpr,
    DL: tl.constexpr,
    DR: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_DL: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    PAGED: tl.constexpr,
    CAUSAL: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """The transposed form (module docstring): scores ``[BLOCK_N, BLOCK_R]`` as ``K Q^T``, the output accumulated as
    ``O^T [BLOCK_DL, BLOCK_R]`` (one value block), stored through transposed pointers (no dot result is ever
    transposed). Grid ``(row blocks, NUM_SPLITS, B)``."""
    R: tl.constexpr = T * H
    D: tl.constexpr = DL + DR
    i_r = tl.program_id(0)
    i_s = tl.program_id(1)
    i_b = tl.program_id(2)
    i_b64 = i_b.to(tl.int64)
    L = tl.load(Lens + i_b)
    n_blocks = tl.cdiv(L, BLOCK_N)
    per_split = tl.cdiv(n_blocks, NUM_SPLITS)
    k_start = i_s * per_split * BLOCK_N
    k_stop = tl.minimum(k_start + per_split * BLOCK_N, L)
    if CAUSAL:
        t_last = tl.minimum(i_r * BLOCK_R + BLOCK_R - 1, R - 1) // H
        k_stop = tl.minimum(k_stop, t_last + L - T + 1)

    rows = i_r * BLOCK_R + tl.arange(0, BLOCK_R)
    m_r = rows < R
    o_l = tl.arange(0, BLOCK_DL)
    m_l = o_l < DL
    p_q = Q + (i_b64 * R + rows)[None, :] * D  # [1, BR]
    # the query tiles transposed through the pointers: [dims, BR], the score dots' right operands as they are
    b_qlt = tl.load(p_q + o_l[:, None], mask=m_l[:, None] & m_r[None, :], other=0.0)  # [BDL, BR]
    if DR > 0:
        o_r = tl.arange(0, BLOCK_DR)
        m_rd = o_r < DR
        b_qrt = tl.load(p_q + DL + o_r[:, None], mask=m_rd[:, None] & m_r[None, :], other=0.0)  # [BDR, BR]
    if CAUSAL:
        last_key = rows // H + L - T  # [BR]: the last key each row admits

    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_DL, BLOCK_R], tl.float32)  # O transposed
    for start in range(k_start, k_stop, BLOCK_N):
        tokens = start + tl.arange(0, BLOCK_N)
        ok = tokens < k_stop
        p_kv = KV + _token_rows(Tables, i_b64, start, tokens, ok, M, S, P, PAGE, PAGED, BLOCK_N) * D  # [BN]
        b_kl = tl.load(p_kv[:, None] + o_l[None, :], mask=ok[:, None] & m_l[None, :], other=0.0)  # [BN, BDL]
        b_st = mma(b_kl, b_qlt, tl.zeros([BLOCK_N, BLOCK_R], tl.float32))  # [BN, BR]
        if DR > 0:
            b_kr = tl.load(p_kv[:, None] + DL + o_r[None, :], mask=ok[:, None] & m_rd[None, :], other=0.0)
            b_st = mma(b_kr, b_qrt, b_st)
        b_st = b_st * (sm_scale * LOG2E)
        admitted = ok[:, None]
        if CAUSAL:
            admitted = admitted & (tokens[:, None] <= last_key[None, :])
        b_st = tl.where(admitted, b_st, float("-inf"))
        # the online softmax down the columns (one per query row); a row that has seen only -inf keeps 0 as its
        # reference point, so exp2(-inf - m) is 0, never NaN
        m_new = tl.maximum(m_i, tl.max(b_st, 0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        b_pt = tl.exp2(b_st - m_ref[None, :])  # [BN, BR]
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(b_pt, 0)
        m_i = m_new
        acc = acc * alpha[None, :]
        acc = mma(tl.trans(b_kl), b_pt.to(b_kl.dtype), acc)  # [BDL, BR] += V^T P^T

    seen = l_i > 0.0
    b_o = acc / tl.where(seen, l_i, 1.0)[None, :]
    out_rows = (i_b64 * NUM_SPLITS + i_s) * R + rows
    # stored transposed through the pointers: o [B * NUM_SPLITS * R, DL] as in the other form
    tl.store(O + out_rows[None, :] * DL + o_l[:, None], b_o, mask=m_l[:, None] & m_r[None, :])
    b_lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    tl.store(Lse + out_rows, b_lse, mask=m_r)
