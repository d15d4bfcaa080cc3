"""The transposed MLA decode kernel (an experiment timed by ``mla_variants.py``)."""

import triton
import triton.language as tl

from ejkernel_triton._mla_kernels import _token_rows
from ejkernel_triton.language import LN2, LOG2E, mma


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
    b_qlt = tl.load(p_q + o_l[:, None], mask=m_l[:, None] & m_r[None, :], other=0.0)  # [BDL, BR]
    if DR > 0:
        o_r = tl.arange(0, BLOCK_DR)
        m_rd = o_r < DR
        b_qrt = tl.load(p_q + DL + o_r[:, None], mask=m_rd[:, None] & m_r[None, :], other=0.0)  # [BDR, BR]
    if CAUSAL:
        last_key = rows // H + L - T

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
    tl.store(O + out_rows[None, :] * DL + o_l[:, None], b_o, mask=m_l[:, None] & m_r[None, :])
    b_lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    tl.store(Lse + out_rows, b_lse, mask=m_r)
