"""The chunked kernels of linear attention with one scalar log decay per token and head (``simple_gla``), forward
and backward.

Per sequence and head the recurrence ``S_t = exp(g_t) S_{t-1} + k_t^T v_t``, ``o_t = scale q_t S_t`` is cut into
chunks of ``BT`` tokens. With ``b`` the cumulative log decay from the chunk's start (token included; masked rows
add 0, so ``b[BT - 1]`` is the chunk's total ``b_L``), a chunk entered with state ``S`` gives::

    o_i    = scale (exp(b_i) q_i S  +  sum_{j <= i} (q_i . k_j) exp(b_i - b_j) v_j)
    S_next = exp(b_L) S  +  sum_j exp(b_L - b_j) k_j^T v_j

The decay being one number per row, the intra-chunk scores are one product ``q @ k^T`` times ``exp(b_i - b_j)``
(exponent <= 0 for ``j <= i`` when ``g <= 0``; the pairs ``j > i`` are masked *before* the ``exp``), and the row
factors ``exp(b_i)``, ``exp(b_L - b_j)`` of ``q @ h``, ``do @ h^T``, ``v @ dhe^T`` and ``k @ dhe`` apply after the
product (exact operands). Only the state passes contract over the rows with a factor: ``k exp(b_L - b)`` and
``q exp(b)`` are split in two bfloat16 parts for bfloat16 inputs (:func:`mm`'s ``SA``) where float32 accuracy is
needed (the returned final state, the backward's states, the initial state's and the gates' gradients).

Kernels (the forward is the first two; the backward recomputes the states at float32 accuracy, then the rest):

* :func:`simple_state_fwd`: one program per (sequence, head, key tile, value tile) walks the chunks and stores the
  state at each chunk's start ``h [NT, H, K, V]`` (in ``h``'s dtype) and the final state (float32);
* :func:`simple_output`: ``o`` per (chunk, value tile);
* :func:`simple_state_bwd`: the state's gradient, chunks in reverse: ``dhe`` (at each chunk's *end*) and ``dh0``;
* :func:`simple_state_pair`: the backward's recompute of the states and :func:`simple_state_bwd` in one launch, when
  the plan pairs them (``Plan.paired_states``; not yet the default: being checked on the H200);
* :func:`simple_dv`: ``dv`` per (chunk, value tile);
* :func:`simple_dqk`: ``dq``, ``dk`` and this key tile's share of ``dg`` per (chunk, key tile) (the shares are
  summed by the caller; :func:`simple_dqk` says how ``dg`` is made chunk-locally).

Layouts (C-contiguous; ``R = B T`` rows of tokens, ``N`` sequences, ``NT`` chunks over all sequences): ``q``,
``k [R, H, DK]``; ``v``, ``o``, ``do [R, H, DV]``; ``g [R, H]`` float32; ``Cu [N + 1]``, ``ChunkOff [N + 1]``,
``ChunkSeq [NT]`` int32 (the chunk table of ``ejkernel_triton.gla.chunk``); states ``[NT or N, H, DK, DV]``.

Dots (:func:`mm`; it, the loads and the chunk table's reader are ``ejkernel_triton._chunk_kernels``'): operands in
``DOT`` (``"bf16"`` for bfloat16 inputs, else ``"fp32"`` at ``PREC``), float32 accumulation; in the interpreter
(``EMU``), whose 16-bit dots are wrong, float32 operands holding rounded values.
Dot results are never transposed (``tl.trans`` of a dot accumulator is miscompiled by Triton 3.6 on Hopper):
transposed operands are loaded transposed, and ``dA^T`` is its own product (:func:`simple_dqk`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ejkernel_triton import launch as _launch  # noqa: F401  (the interpreter switch, before any @triton.jit)
from ejkernel_triton._chunk_kernels import chunk_span, mm, raw, state_at, walk_program

# ------------------------------------------------------------------------------------------------
# Helpers.
# ------------------------------------------------------------------------------------------------


@triton.jit
def cum_gate(G, rows, m_t, i_h, H: tl.constexpr, BT: tl.constexpr):
    """``(b [BT], b_L)``: the chunk's cumulative log decay (masked rows add 0) and its total."""
    b = tl.cumsum(tl.load(G + rows * H + i_h, mask=m_t, other=0.0).to(tl.float32), axis=0)
    b_l = tl.sum(tl.where(tl.arange(0, BT) == BT - 1, b, 0.0), axis=0)
    return b, b_l


@triton.jit
def decay(b, n_rows, BT: tl.constexpr, TRANS: tl.constexpr):
    """``exp(b_i - b_j)`` on the valid pairs ``j <= i`` of the chunk, else 0 (``[i, j]``; ``TRANS``: ``[j, i]``)."""
    o_t = tl.arange(0, BT)
    if TRANS:
        m = (o_t[None, :] >= o_t[:, None]) & (o_t[None, :] < n_rows)
        e = tl.exp(tl.where(m, b[None, :] - b[:, None], float("-inf")))
    else:
        m = (o_t[:, None] >= o_t[None, :]) & (o_t[:, None] < n_rows)
        e = tl.exp(tl.where(m, b[:, None] - b[None, :], float("-inf")))
    return e


# ------------------------------------------------------------------------------------------------
# Forward.
# ------------------------------------------------------------------------------------------------


@triton.jit
def simple_walk_fwd(
    K_,
    V_,
    G,
    H0,
    Cu,
    ChunkOff,
    Hs,
    HT,
    i_p,
    i_h,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_H0: tl.constexpr,
    SPLIT: tl.constexpr,
    PREC: tl.constexpr,
    DOT: tl.constexpr,
    EMU: tl.constexpr,
):
    """Program ``(i_p, i_h)`` of :func:`simple_state_fwd`: the state at each chunk's start (``Hs``) and after the
    last (``HT``), one ``[BK, BV]`` tile. ``SPLIT``: the update's ``k exp(b_L - b)`` split (float32 accuracy)."""
    i_n, bos, eos, c0, n_chunks, o_k, o_v = walk_program(i_p, Cu, ChunkOff, DK, DV, BK, BV)
    o_t = tl.arange(0, BT)
    m_k = o_k < DK
    m_v = o_v < DV
    m_h = m_k[:, None] & m_v[None, :]
    p_off = o_k[:, None] * DV + o_v[None, :]

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        b_h += state_at(H0, i_n, i_h, o_k[:, None], o_v[None, :], m_k[:, None], m_v[None, :], H, DK, DV)
    for i_c in range(n_chunks):
        i_t = c0 + i_c
        tl.store(Hs + (i_t.to(tl.int64) * H + i_h) * (DK * DV) + p_off, b_h.to(Hs.dtype.element_ty), mask=m_h)
        rows = bos + i_c * BT + o_t
        m_t = rows < eos
        b, b_l = cum_gate(G, rows, m_t, i_h, H, BT)
        b_kT = raw(K_, rows[None, :], o_k[:, None], m_k[:, None] & m_t[None, :], i_h, H, DK, EMU).to(tl.float32)
        b_v = raw(V_, rows[:, None], o_v[None, :], m_t[:, None] & m_v[None, :], i_h, H, DV, EMU)  # [BT, BV]
        b_h = mm(b_kT * tl.exp(b_l - b)[None, :], b_v, b_h * tl.exp(b_l), SPLIT, 0, DOT, EMU, PREC)
    tl.store(HT + (i_n.to(tl.int64) * H + i_h) * (DK * DV) + p_off, b_h, mask=m_h)


@triton.jit
def simple_state_fwd(
    K_,
    V_,
    G,
    H0,
    Cu,
    ChunkOff,
    Hs,
    HT,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_H0: tl.constexpr,
    SPLIT: tl.constexpr,
    PREC: tl.constexpr,
    DOT: tl.constexpr,
    EMU: tl.constexpr,
):
    """The state at each chunk's start (``Hs``) and after the last (``HT``), one ``[BK, BV]`` tile per program
    (:func:`simple_walk_fwd`). Grid ``(N * cdiv(DK, BK) * cdiv(DV, BV), H)``."""
    simple_walk_fwd(
        K_,
        V_,
        G,
        H0,
        Cu,
        ChunkOff,
        Hs,
        HT,
        tl.program_id(0),
        tl.program_id(1),
        H,
        DK,
        DV,
        BT,
        BK,
        BV,
        HAS_H0,
        SPLIT,
        PREC,
        DOT,
        EMU,
    )


@triton.jit
def simple_output(
    Q,
    K_,
    V_,
    G,
    Hs,
    Cu,
    ChunkSeq,
    ChunkOff,
    scale,
    O,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    PREC: tl.constexpr,
    DOT: tl.constexpr,
    EMU: tl.constexpr,
):
    """``o = scale (exp(b) * (q @ h) + (q @ k^T * decay) @ v)`` for one chunk and value tile (``q @ k^T`` again
    per value tile). Grid ``(NT * cdiv(DV, BV), H)``."""
    NV: tl.constexpr = (DV + BV - 1) // BV
    i_p, i_h = tl.program_id(0), tl.program_id(1)  # the value tiles of one chunk side by side (shared reads)
    i_t = i_p // NV
    i_v = i_p % NV
    _, bos, n_rows = chunk_span(Cu, ChunkSeq, ChunkOff, i_t, BT)
    o_t = tl.arange(0, BT)
    m_t = o_t < n_rows
    rows = bos + o_t
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < DV
    m_tv = m_t[:, None] & m_v[None, :]

    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    b_s = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(DK, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < DK
        b_q = raw(Q, rows[:, None], o_k[None, :], m_t[:, None] & m_k[None, :], i_h, H, DK, EMU)  # [BT, BK]
        b_kT = raw(K_, rows[None, :], o_k[:, None], m_k[:, None] & m_t[None, :], i_h, H, DK, EMU)  # [BK, BT]
        b_h = state_at(Hs, i_t, i_h, o_k[:, None], o_v[None, :], m_k[:, None], m_v[None, :], H, DK, DV)
        b_s = mm(b_q, b_kT, b_s, 0, 0, DOT, EMU, PREC)
        b_o = mm(b_q, b_h, b_o, 0, 0, DOT, EMU, PREC)
    b, _ = cum_gate(G, rows, m_t, i_h, H, BT)
    b_v = raw(V_, rows[:, None], o_v[None, :], m_tv, i_h, H, DV, EMU)
    b_o = mm(b_s * decay(b, n_rows, BT, False), b_v, b_o * tl.exp(b)[:, None], 0, 0, DOT, EMU, PREC)
    tl.store(O + (rows[:, None] * H + i_h) * DV + o_v[None, :], (b_o * scale).to(O.dtype.element_ty), mask=m_tv)


# ------------------------------------------------------------------------------------------------
# Backward.
# ------------------------------------------------------------------------------------------------


@triton.jit
def simple_walk_bwd(
    Q,
    DO,
    G,
    DHT,
    Cu,
    ChunkOff,
    scale,
    DHE,
    DH0,
    i_p,
    i_h,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_DHT: tl.constexpr,
    PREC: tl.constexpr,
    DOT: tl.constexpr,
    EMU: tl.constexpr,
):
    """Program ``(i_p, i_h)`` of :func:`simple_state_bwd`: the state's gradient, chunks in reverse: ``DHE`` at each
    chunk's end, ``DH0`` before the first (``DHT`` for an empty sequence); ``dS <- exp(b_L) dS + scale (q exp(b))^T
    @ do``, the left operand split."""
    i_n, bos, eos, c0, n_chunks, o_k, o_v = walk_program(i_p, Cu, ChunkOff, DK, DV, BK, BV)
    o_t = tl.arange(0, BT)
    m_k = o_k < DK
    m_v = o_v < DV
    m_h = m_k[:, None] & m_v[None, :]
    p_off = o_k[:, None] * DV + o_v[None, :]

    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        b_dh += state_at(DHT, i_n, i_h, o_k[:, None], o_v[None, :], m_k[:, None], m_v[None, :], H, DK, DV)
    for i_r in range(n_chunks):
        i_c = n_chunks - 1 - i_r
        i_t = c0 + i_c
        tl.store(DHE + (i_t.to(tl.int64) * H + i_h) * (DK * DV) + p_off, b_dh, mask=m_h)
        rows = bos + i_c * BT + o_t
        m_t = rows < eos
        b, b_l = cum_gate(G, rows, m_t, i_h, H, BT)
        b_qT = raw(Q, rows[None, :], o_k[:, None], m_k[:, None] & m_t[None, :], i_h, H, DK, EMU).to(tl.float32)
        b_do = raw(DO, rows[:, None], o_v[None, :], m_t[:, None] & m_v[None, :], i_h, H, DV, EMU)  # [BT, BV]
        b_dh = mm(b_qT * (tl.exp(b) * scale)[None, :], b_do, b_dh * tl.exp(b_l), 1, 0, DOT, EMU, PREC)
    tl.store(DH0 + (i_n.to(tl.int64) * H + i_h) * (DK * DV) + p_off, b_dh, mask=m_h)


@triton.jit
def simple_state_bwd(
    Q,
    DO,
    G,
    DHT,
    Cu,
    ChunkOff,
    scale,
    DHE,
    DH0,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_DHT: tl.constexpr,
    PREC: tl.constexpr,
    DOT: tl.constexpr,
    EMU: tl.constexpr,
):
    """The state's gradient, chunks in reverse (:func:`simple_walk_bwd`). Grid ``(N * cdiv(DK, BK) * cdiv(DV, BV),
    H)``."""
    simple_walk_bwd(
        Q,
        DO,
        G,
        DHT,
        Cu,
        ChunkOff,
        scale,
        DHE,
        DH0,
        tl.program_id(0),
        tl.program_id(1),
        H,
        DK,
        DV,
        BT,
        BK,
        BV,
        HAS_DHT,
        PREC,
        DOT,
        EMU,
    )


@triton.jit
def simple_state_pair(
    K_,
    V_,
    Q,
    DO,
    G,
    H0,
    DHT,
    Cu,
    ChunkOff,
    scale,
    Hs,
    HT,
    DHE,
    DH0,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_H0: tl.constexpr,
    HAS_DHT: tl.constexpr,
    PREC: tl.constexpr,
    DOT: tl.constexpr,
    EMU: tl.constexpr,
):
    """The backward's two state walks in one launch (as ``_chunk_kernels.chunk_state_pair``): :func:`simple_walk_fwd`
    (float32 states, ``SPLIT``) over the first half of the grid's first axis, :func:`simple_walk_bwd` over the
    second. Grid ``(2 * N * cdiv(DK, BK) * cdiv(DV, BV), H)``."""
    half = tl.num_programs(0) // 2
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    if i_p < half:
        simple_walk_fwd(
            K_, V_, G, H0, Cu, ChunkOff, Hs, HT, i_p, i_h, H, DK, DV, BT, BK, BV, HAS_H0, True, PREC, DOT, EMU
        )
    else:
        simple_walk_bwd(
            Q,
            DO,
            G,
            DHT,
            Cu,
            ChunkOff,
            scale,
            DHE,
            DH0,
            i_p - half,
            i_h,
            H,
            DK,
            DV,
            BT,
            BK,
            BV,
            HAS_DHT,
            PREC,
            DOT,
            EMU,
        )


@triton.jit
def simple_dv(
    Q,
    K_,
    G,
    DO,
    DHE,
    Cu,
    ChunkSeq,
    ChunkOff,
    scale,
    DV_,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    PREC: tl.constexpr,
    DOT: tl.constexpr,
    EMU: tl.constexpr,
):
    """``dv = (scale k @ q^T * decay^T) @ do + exp(b_L - b) * (k @ dhe)`` for one chunk and value tile. Grid
    ``(NT * cdiv(DV, BV), H)``."""
    NV: tl.constexpr = (DV + BV - 1) // BV
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    i_t = i_p // NV
    i_v = i_p % NV
    _, bos, n_rows = chunk_span(Cu, ChunkSeq, ChunkOff, i_t, BT)
    o_t = tl.arange(0, BT)
    m_t = o_t < n_rows
    rows = bos + o_t
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < DV
    m_tv = m_t[:, None] & m_v[None, :]

    b_dv = tl.zeros([BT, BV], dtype=tl.float32)
    b_sT = tl.zeros([BT, BT], dtype=tl.float32)  # [j, i] = k_j . q_i
    for i_k in range(tl.cdiv(DK, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < DK
        b_k = raw(K_, rows[:, None], o_k[None, :], m_t[:, None] & m_k[None, :], i_h, H, DK, EMU)  # [BT, BK]
        b_qT = raw(Q, rows[None, :], o_k[:, None], m_k[:, None] & m_t[None, :], i_h, H, DK, EMU)  # [BK, BT]
        b_dhe = state_at(DHE, i_t, i_h, o_k[:, None], o_v[None, :], m_k[:, None], m_v[None, :], H, DK, DV)
        b_sT = mm(b_k, b_qT, b_sT, 0, 0, DOT, EMU, PREC)
        b_dv = mm(b_k, b_dhe, b_dv, 0, 0, DOT, EMU, PREC)
    b, b_l = cum_gate(G, rows, m_t, i_h, H, BT)
    b_do = raw(DO, rows[:, None], o_v[None, :], m_tv, i_h, H, DV, EMU)
    b_dv = mm(b_sT * (decay(b, n_rows, BT, True) * scale), b_do, b_dv * tl.exp(b_l - b)[:, None], 0, 0, DOT, EMU, PREC)
    tl.store(DV_ + (rows[:, None] * H + i_h) * DV + o_v[None, :], b_dv.to(DV_.dtype.element_ty), mask=m_tv)


@triton.jit
def simple_dqk(
    Q,
    K_,
    V_,
    G,
    DO,
    Hs,
    DHE,
    Cu,
    ChunkSeq,
    ChunkOff,
    scale,
    DQ,
    DK_,
    DG,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    PREC: tl.constexpr,
    DOT: tl.constexpr,
    EMU: tl.constexpr,
):
    """``dq``, ``dk`` of one chunk and key tile, and the tile's share of ``dg`` (``DG [R, H, NK]`` float32, summed
    by the caller). With ``D = scale (do @ v^T) * decay`` (``D^T`` its own product ``v @ do^T``, in a second pass
    over the value tiles)::

        dq = scale exp(b) * (do @ h^T) + D @ k             dk = D^T @ q + exp(b_L - b) * (v @ dhe^T)

    and, per row ``t`` (``h`` the state at the chunk's start, ``dhe`` its gradient at the chunk's end)::

        dg_t = sum_{s >= t} u_s + sum_{s < t} w_s + exp(b_L) <h, dhe>
        u = scale exp(b) q . (do @ h^T) + rowsum(M) - colsum(M),  M = D * (q @ k^T),   w = exp(b_L - b) k . (v @ dhe^T)

    (``u``: what ``b_t`` does to the chunk's outputs; ``w``: what ``b_L - b_t`` does to the state it passes on).
    Every term is chunk-local and of float32 accuracy for bfloat16 inputs: ``q @ k^T`` and ``do @ v^T`` are of
    exact operands, and ``do @ h^T``, ``v @ dhe^T`` split the state. Grid ``(NT * cdiv(DK, BK), H)``."""
    NK: tl.constexpr = (DK + BK - 1) // BK
    i_p, i_h = tl.program_id(0), tl.program_id(1)  # the key tiles of one chunk side by side (shared reads)
    i_t = i_p // NK
    i_k = i_p % NK
    _, bos, n_rows = chunk_span(Cu, ChunkSeq, ChunkOff, i_t, BT)
    o_t = tl.arange(0, BT)
    m_t = o_t < n_rows
    rows = bos + o_t
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < DK
    m_tk = m_t[:, None] & m_k[None, :]

    b_da = tl.zeros([BT, BT], dtype=tl.float32)  # [i, j] = do_i . v_j
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_hd = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(tl.cdiv(DV, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < DV
        m_tv = m_t[:, None] & m_v[None, :]
        b_do = raw(DO, rows[:, None], o_v[None, :], m_tv, i_h, H, DV, EMU)  # [BT, BV]
        b_v = raw(V_, rows[:, None], o_v[None, :], m_tv, i_h, H, DV, EMU)
        b_vT = raw(V_, rows[None, :], o_v[:, None], m_v[:, None] & m_t[None, :], i_h, H, DV, EMU)  # [BV, BT]
        b_hT = state_at(Hs, i_t, i_h, o_k[None, :], o_v[:, None], m_k[None, :], m_v[:, None], H, DK, DV)  # [BV, BK]
        b_dheT = state_at(DHE, i_t, i_h, o_k[None, :], o_v[:, None], m_k[None, :], m_v[:, None], H, DK, DV)
        b_da = mm(b_do, b_vT, b_da, 0, 0, DOT, EMU, PREC)
        b_dq = mm(b_do, b_hT, b_dq, 0, 1, DOT, EMU, PREC)
        b_dk = mm(b_v, b_dheT, b_dk, 0, 1, DOT, EMU, PREC)
        b_hd += tl.sum(b_hT * b_dheT, axis=0)
    b, b_l = cum_gate(G, rows, m_t, i_h, H, BT)
    b_q = raw(Q, rows[:, None], o_k[None, :], m_tk, i_h, H, DK, EMU)  # [BT, BK]
    b_k = raw(K_, rows[:, None], o_k[None, :], m_tk, i_h, H, DK, EMU)
    b_kT = raw(K_, rows[None, :], o_k[:, None], m_k[:, None] & m_t[None, :], i_h, H, DK, EMU)  # [BK, BT]
    b_s = mm(b_q, b_kT, tl.zeros([BT, BT], dtype=tl.float32), 0, 0, DOT, EMU, PREC)  # this tile's q @ k^T
    b_d = b_da * (decay(b, n_rows, BT, False) * scale)
    # the diagonal cancels exactly in rowsum - colsum; left in, its rounding (decay 1 there) swamps the crossing
    # pairs' terms (decay exp(b_i - b_j), tiny under strong decay) that dg is made of
    b_m = tl.where(o_t[:, None] > o_t[None, :], b_d * b_s, 0.0)
    e_q = tl.exp(b) * scale  # [BT]
    e_k = tl.exp(b_l - b)
    b_u = e_q * tl.sum(b_q.to(tl.float32) * b_dq, axis=1) + tl.sum(b_m, axis=1) - tl.sum(b_m, axis=0)
    b_w = e_k * tl.sum(b_k.to(tl.float32) * b_dk, axis=1)
    b_dg = tl.cumsum(b_u, axis=0, reverse=True) + (tl.cumsum(b_w, axis=0) - b_w) + tl.exp(b_l) * tl.sum(b_hd, axis=0)
    tl.store(DG + (rows * H + i_h) * NK + i_k, b_dg, mask=m_t)
    p_x = (rows[:, None] * H + i_h) * DK + o_k[None, :]
    b_dq = mm(b_d, b_k, b_dq * e_q[:, None], 0, 0, DOT, EMU, PREC)
    tl.store(DQ + p_x, b_dq.to(DQ.dtype.element_ty), mask=m_tk)
    # dA^T in a second pass over the value tiles, once dA and dq are done with: fewer accumulators live at once
    # (at 4 warps, both [BT, BT] ones beside dq and dk spilled registers on sm_90)
    b_daT = tl.zeros([BT, BT], dtype=tl.float32)  # [j, i] = v_j . do_i
    for i_v in range(tl.cdiv(DV, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < DV
        b_v = raw(V_, rows[:, None], o_v[None, :], m_t[:, None] & m_v[None, :], i_h, H, DV, EMU)
        b_doT = raw(DO, rows[None, :], o_v[:, None], m_v[:, None] & m_t[None, :], i_h, H, DV, EMU)  # [BV, BT]
        b_daT = mm(b_v, b_doT, b_daT, 0, 0, DOT, EMU, PREC)
    b_dk = mm(b_daT * (decay(b, n_rows, BT, True) * scale), b_q, b_dk * e_k[:, None], 0, 0, DOT, EMU, PREC)
    tl.store(DK_ + p_x, b_dk.to(DK_.dtype.element_ty), mask=m_tk)
