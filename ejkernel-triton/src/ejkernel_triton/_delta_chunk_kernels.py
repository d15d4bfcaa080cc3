"""The chunked forward kernels of ``gated_delta_rule`` (the WY representation), three launches.

Per sequence and value head the rule ``S_t = exp(g_t) S_{t-1}``, ``S_t += beta_t k_t (v_t - S_t^T k_t)^T``,
``o_t = scale S_t^T q_t`` is cut into chunks of ``BT`` tokens. With ``b`` the chunk-local cumulative log gate (token
included) and ``S`` the state the chunk is entered with, the chunk's corrected values ``U'`` solve

    (I + A) U' = beta V - (beta exp(b) K) S,   A_ij = beta_i exp(b_i - b_j) k_i . k_j  (j < i, else 0)

so ``U' = u - w S`` with ``T = (I + A)^-1``, ``u = T (beta V)``, ``w = T (beta exp(b) K)`` (chunk-local: no state
needed), and then

    O      = scale ((Q * exp(b)) S  +  (Q K^T * exp(b_i - b_j), j <= i) U')
    S_next = exp(b_L) S  +  (K * exp(b_L - b))^T U'                          (b_L: the chunk's last valid row)

* :func:`delta_prep`: ``b``, ``w`` and ``u`` of every chunk (``T`` by forward substitution, row by row);
* :func:`delta_states`: one program per (sequence, value head, value block) walks the chunks with its
  ``[DK, BV]`` state tile in registers; stores ``U'`` and the state at each chunk's start, and the final state;
* :func:`delta_output`: ``O`` chunk by chunk.

Gates are log decays (``<= 0``), so ``b`` does not increase along a chunk and no exponent taken is positive
(the differences are masked to ``j <= i`` before ``exp``). Padded rows (past a sequence's end) read ``k``, ``v``,
``beta`` and ``g`` as 0: their rows and columns of ``A`` are 0 and their ``U'`` is 0, so they change nothing.

Layouts (C-contiguous; ``R = B T`` rows of tokens): ``q``, ``k [R, H, DK]`` (float32: ``use_qk_l2norm`` is
applied before); ``v [R, HV, DV]``; ``g``, ``beta [R, HV]``; ``w [R, HV, DK]``, ``u``, ``U' [R, HV, DV]``,
``b [R, HV]`` float32; states ``[N or NT, HV, DK, DV]`` float32; the chunk table of
``ejkernel_triton._chunk_kernels`` (``Cu``, ``ChunkSeq``, ``ChunkOff``). Value head ``hv`` reads query/key head
``hv // (HV // H)``. Every product is a float32 dot at ``PREC``. No dot result is transposed (Triton 3.6
miscompiles ``tl.trans`` of a Hopper dot accumulator): transposed operands are loaded transposed from memory.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ejkernel_triton._chunk_kernels import chunk_span, tile


@triton.jit
def _scalar_col(X, rows, mask, i_hv, HV: tl.constexpr):
    """``X[rows, i_hv]`` of a ``[R, HV]`` array as float32, masked elements 0."""
    return tl.load(X + rows * HV + i_hv, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def delta_prep(
    K_,
    V_,
    G,
    Beta,
    Cu,
    ChunkSeq,
    ChunkOff,
    W,
    U,
    B,
    H: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    PREC: tl.constexpr,
):
    """``b``, ``w``, ``u`` of one chunk and value head. Grid ``(NT, HV)``."""
    i_t, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    _, bos, n_rows = chunk_span(Cu, ChunkSeq, ChunkOff, i_t, BT)
    o_t = tl.arange(0, BT)
    m_t = o_t < n_rows
    rows = bos + o_t
    o_k = tl.arange(0, BK)
    m_k = o_k < DK

    b_b = tl.cumsum(_scalar_col(G, rows, m_t, i_hv, HV), axis=0)  # [BT]
    b_beta = _scalar_col(Beta, rows, m_t, i_hv, HV)
    b_k = tile(K_, rows[:, None], o_k[None, :], m_t[:, None] & m_k[None, :], i_h, H, DK)  # [BT, BK]
    b_kT = tile(K_, rows[None, :], o_k[:, None], m_k[:, None] & m_t[None, :], i_h, H, DK)  # [BK, BT]
    lower = o_t[:, None] > o_t[None, :]
    decay = tl.exp(tl.where(lower, b_b[:, None] - b_b[None, :], 0.0))
    b_a = tl.dot(b_k, b_kT, input_precision=PREC) * decay * b_beta[:, None]
    b_a = tl.where(lower, b_a, 0.0)  # [BT, BT], strictly lower

    # T = (I + A)^-1, unit lower triangular: row i is e_i - A[i, :] T (the rows above it are final already).
    b_tri = tl.where(o_t[:, None] == o_t[None, :], 1.0, 0.0)
    for i in range(1, BT):
        pick = o_t[:, None] == i
        a_i = tl.sum(tl.where(pick, b_a, 0.0), axis=0)  # [BT]: A[i, :]
        row = tl.where(o_t == i, 1.0, 0.0) - tl.sum(a_i[:, None] * b_tri, axis=0)
        b_tri = tl.where(pick, row[None, :], b_tri)

    b_kw = b_k * (b_beta * tl.exp(b_b))[:, None]
    b_w = tl.dot(b_tri, b_kw, input_precision=PREC)  # [BT, BK]
    tl.store(W + (rows[:, None] * HV + i_hv) * DK + o_k[None, :], b_w, mask=m_t[:, None] & m_k[None, :])
    tl.store(B + rows * HV + i_hv, b_b, mask=m_t)
    for i_v in range(tl.cdiv(DV, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < DV)[None, :]
        b_v = tile(V_, rows[:, None], o_v[None, :], m_tv, i_hv, HV, DV)  # [BT, BV]
        b_u = tl.dot(b_tri, b_v * b_beta[:, None], input_precision=PREC)
        tl.store(U + (rows[:, None] * HV + i_hv) * DV + o_v[None, :], b_u, mask=m_tv)


@triton.jit
def delta_states(
    K_,
    W,
    U,
    B,
    H0,
    Cu,
    ChunkOff,
    UC,
    Hs,
    HT,
    H: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_H0: tl.constexpr,
    PREC: tl.constexpr,
):
    """``U'`` (``UC``), the state at each chunk's start (``Hs``) and the final state (``HT``). Grid
    ``(N * cdiv(DV, BV), HV)``."""
    NV: tl.constexpr = (DV + BV - 1) // BV
    i_p, i_hv = tl.program_id(0), tl.program_id(1)
    i_n = i_p // NV
    i_v = i_p % NV
    i_h = i_hv // (HV // H)
    bos = tl.load(Cu + i_n).to(tl.int64)
    eos = tl.load(Cu + i_n + 1).to(tl.int64)
    c0 = tl.load(ChunkOff + i_n)
    n_chunks = tl.load(ChunkOff + i_n + 1) - c0

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < DK
    m_v = o_v < DV
    m_h = m_k[:, None] & m_v[None, :]
    p_off = o_k[:, None] * DV + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        b_h += tl.load(H0 + (i_n.to(tl.int64) * HV + i_hv) * (DK * DV) + p_off, mask=m_h, other=0.0)
    for i_c in range(n_chunks):
        i_t = c0 + i_c
        tl.store(Hs + (i_t.to(tl.int64) * HV + i_hv) * (DK * DV) + p_off, b_h, mask=m_h)
        start = bos + i_c * BT
        n_rows = tl.minimum(eos - start, BT)
        rows = start + o_t
        m_t = o_t < n_rows
        m_tv = m_t[:, None] & m_v[None, :]
        b_w = tile(W, rows[:, None], o_k[None, :], m_t[:, None] & m_k[None, :], i_hv, HV, DK)  # [BT, BK]
        b_u = tile(U, rows[:, None], o_v[None, :], m_tv, i_hv, HV, DV)  # [BT, BV]
        b_uc = b_u - tl.dot(b_w, b_h, input_precision=PREC)  # U' = u - w S
        tl.store(UC + (rows[:, None] * HV + i_hv) * DV + o_v[None, :], b_uc, mask=m_tv)
        b_b = _scalar_col(B, rows, m_t, i_hv, HV)
        b_bl = tl.sum(tl.where(o_t == n_rows - 1, b_b, 0.0), axis=0)  # the chunk's total log decay
        b_kT = tile(K_, rows[None, :], o_k[:, None], m_k[:, None] & m_t[None, :], i_h, H, DK)  # [BK, BT]
        b_kT = b_kT * tl.exp(tl.where(m_t, b_bl - b_b, 0.0))[None, :]
        b_h = b_h * tl.exp(b_bl) + tl.dot(b_kT, b_uc, input_precision=PREC)
    tl.store(HT + (i_n.to(tl.int64) * HV + i_hv) * (DK * DV) + p_off, b_h, mask=m_h)


@triton.jit
def delta_output(
    Q,
    K_,
    B,
    Hs,
    UC,
    Cu,
    ChunkSeq,
    ChunkOff,
    scale,
    O,
    H: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    PREC: tl.constexpr,
):
    """``O`` of one chunk, value head and value block. Grid ``(NT * cdiv(DV, BV), HV)``."""
    NV: tl.constexpr = (DV + BV - 1) // BV
    i_p, i_hv = tl.program_id(0), tl.program_id(1)  # the value blocks of one chunk side by side (shared reads)
    i_t = i_p // NV
    i_v = i_p % NV
    i_h = i_hv // (HV // H)
    _, bos, n_rows = chunk_span(Cu, ChunkSeq, ChunkOff, i_t, BT)
    o_t = tl.arange(0, BT)
    m_t = o_t < n_rows
    rows = bos + o_t
    o_k = tl.arange(0, BK)
    m_k = o_k < DK
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < DV
    m_tv = m_t[:, None] & m_v[None, :]

    b_b = _scalar_col(B, rows, m_t, i_hv, HV)
    b_q = tile(Q, rows[:, None], o_k[None, :], m_t[:, None] & m_k[None, :], i_h, H, DK)  # [BT, BK]
    b_kT = tile(K_, rows[None, :], o_k[:, None], m_k[:, None] & m_t[None, :], i_h, H, DK)  # [BK, BT]
    causal = (o_t[:, None] >= o_t[None, :]) & m_t[:, None]
    b_s = tl.dot(b_q, b_kT, input_precision=PREC) * tl.exp(tl.where(causal, b_b[:, None] - b_b[None, :], 0.0))
    b_s = tl.where(causal, b_s, 0.0)  # [BT, BT]
    b_h = tl.load(
        Hs + (i_t.to(tl.int64) * HV + i_hv) * (DK * DV) + o_k[:, None] * DV + o_v[None, :],
        mask=m_k[:, None] & m_v[None, :],
        other=0.0,
    )  # [BK, BV]
    b_uc = tile(UC, rows[:, None], o_v[None, :], m_tv, i_hv, HV, DV)  # [BT, BV]
    b_o = tl.dot(b_q * tl.exp(tl.where(m_t, b_b, 0.0))[:, None], b_h, input_precision=PREC)
    b_o = tl.dot(b_s, b_uc, b_o, input_precision=PREC) * scale
    tl.store(O + (rows[:, None] * HV + i_hv) * DV + o_v[None, :], b_o.to(O.dtype.element_ty), mask=m_tv)
