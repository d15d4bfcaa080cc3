"""The chunked kernels of ``gated_delta_rule`` (the WY representation): the forward's three launches and the
backward's two more.

Per sequence and value head the rule ``S_t = exp(g_t) S_{t-1}``, ``S_t += beta_t k_t (v_t - S_t^T k_t)^T``,
``o_t = scale S_t^T q_t`` is cut into chunks of ``BT`` tokens. With ``b`` the chunk-local cumulative log gate (token
included) and ``S`` the state the chunk is entered with, the chunk's corrected values ``U'`` solve

    (I + A) U' = beta V - (beta exp(b) K) S,   A_ij = beta_i exp(b_i - b_j) k_i . k_j  (j < i, else 0)

so ``U' = u - w S`` with ``T = (I + A)^-1``, ``u = T (beta V)``, ``w = T (beta exp(b) K)`` (chunk-local: no state
needed), and then

    O      = scale ((Q * exp(b)) S  +  (Q K^T * exp(b_i - b_j), j <= i) U')
    S_next = exp(b_L) S  +  (K * exp(b_L - b))^T U'                          (b_L: the chunk's last valid row)

* :func:`delta_prep`: ``b``, ``w`` and ``u`` of every chunk (``T`` by recursive blocked inversion, ``2 log2(BT) -
  2`` float32 dots at ``TPREC``, instead of a row-by-row forward substitution; the backward also has it store
  ``T``);
* :func:`delta_states`: one program per (sequence, value head, value block) walks the chunks with its
  ``[DK, BV]`` state tile in registers; stores ``U'`` and the state at each chunk's start, and the final state;
* :func:`delta_output`: ``O`` chunk by chunk.

The backward reruns the first two (its own chunk size) and, with ``P = (Q K^T * exp(b_i - b_j), j <= i)``,
``dH`` the gradient of the state a chunk leaves with and ``S`` the one it is entered with:

* :func:`delta_state_bwd`: the chunks in reverse, ``dH`` in registers (one program per sequence, value head and
  value block): ``dU' = scale P^T dO + (K * exp(b_L - b)) dH`` (``P^T`` from the key and query tiles the step loads
  anyway), then ``dH <- exp(b_L) dH + scale (Q * exp(b))^T dO - w^T dU'``; stores ``dU'``, ``dH`` at each chunk's
  end and the initial state's gradient;
* :func:`delta_bwd_grads`, every chunk in parallel: back through ``U' = u - w S``, ``u = T (beta V)``, ``w = T
  (beta exp(b) K)`` and ``T = (I + A)^-1``. With ``dvb = T^T dU'`` (the gradient of ``beta V``): ``dv = beta
  dvb``; the gradient of ``beta exp(b) K`` is ``T^T dw = -dvb S^T = -T^T (dU' S^T)`` (``dw = -dU' S^T``); ``dA =
  -T^T dT T^T = -dvb u^T - (T^T dw) w^T = -dvb U'^T``, kept strictly lower. With ``dP = scale dO U'^T * exp(b_i -
  b_j)`` (``j <= i``) and ``D = dA * beta_i exp(b_i - b_j)`` (``dA_ij`` times ``A_ij``'s factor of ``k_i .
  k_j``), key blocks in turn: ``dq = scale (dO S^T) * exp(b) + dP K``, ``dk`` (``beta exp(b) (T^T dw) + dP^T Q +
  (D + D^T) K + (U' dH^T) * exp(b_L - b)``), then ``dbeta``, ``db`` and ``dg``, the reverse cumulative sum of
  ``db`` within the chunk (``b`` is the chunk-local cumulative sum of ``g``).

The backward's kernels keep their live tiles small (ptxas for sm_90 spilled every one of an earlier version that
held several ``[BT, DK]`` float32 tiles at once): per-row factors scale the smaller operand of a dot or its product
rather than a key tile, and sums over the key dim run in blocks of ``BKC`` channels. The forward's kernels scale
the same way (``w = (T diag(beta exp(b))) K``, ``u = (T diag(beta)) V``: the factors scale ``T``'s columns; the
state's update scales ``U'``), so input tiles go to their dots as loaded (ptxas for sm_90: no spills in the
forward for bfloat16 inputs at chunks of 32 or 64 and value blocks of 32 or 64). Every dot, forward and
backward, rounds both operands to ``DOT`` (``"bf16"`` for bfloat16 inputs, float32 accumulation;
``"fp32"``: float32 operands at ``PREC``; ``EMU``: the interpreter's float32 dots of operands rounded so), but
``T``'s own dots (float32 at ``TPREC``). States held in registers, ``T`` and every sum stay float32.

``db`` gathers every place ``b`` appears: where a factor ``exp(b_i - b_j)`` scales products ``x_i . y_j``, with
``dx``, ``dy`` the gradients through them, ``b_i`` gets ``x_i . dx_i`` and ``b_j`` gets ``-y_j . dy_j`` (so
``q . dq`` for the output's, ``k . dk`` for ``A``'s and ``w``'s factors); ``b_L`` gets ``exp(b_L) sum(S * dH)``
and every key's share of the state at the chunk's end.

Gates are log decays (``<= 0``), so ``b`` does not increase along a chunk and no exponent taken is positive
(the differences are masked to ``j <= i`` before ``exp``). Padded rows (past a sequence's end) read ``k``, ``v``,
``beta`` and ``g`` as 0: their rows and columns of ``A`` are 0 and their ``U'`` is 0, so they change nothing.

Layouts (C-contiguous; ``R = B T`` rows of tokens): ``q``, ``k [R, H, DK]`` (any float dtype; ``use_qk_l2norm`` is
applied before); ``v [R, HV, DV]``; ``g``, ``beta [R, HV]``; ``w [R, HV, DK]``, ``U' [R, HV, DV]`` and the states at
the chunks' starts ``[NT, HV, DK, DV]`` in the dtype of their arrays (forward and backward store them in the dots'
operand dtype, which their dots round them to anyway); ``u [R, HV, DV]``, ``b [R, HV]`` float32;
``T [NT, HV, BT, BT]`` float32; final and initial states float32; the output in its array's dtype; the backward's
``dU' [R, HV, DV]`` and the states' gradients at the chunks' ends ``[NT, HV, DK, DV]`` in the dtype of their arrays
(the dots' operand dtype: only dots read them, but ``sum(S * dH)``), the initial state's float32, the gradients of
``q``, ``k`` (per value head), ``g``, ``beta`` float32, ``dv`` in ``v``'s dtype; the
chunk table of ``ejkernel_triton._chunk_kernels`` (``Cu``, ``ChunkSeq``, ``ChunkOff``). Value head ``hv`` reads
query/key head ``hv // (HV // H)``. No dot result is transposed (Triton 3.6 miscompiles ``tl.trans`` of a Hopper dot
accumulator): transposed operands are loaded transposed from memory.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ejkernel_triton._chunk_kernels import chunk_span, rnd, state_at, tile, walk_program


@triton.jit
def _scalar_col(X, rows, mask, i_hv, HV: tl.constexpr):
    """``X[rows, i_hv]`` of a ``[R, HV]`` array as float32, masked elements 0."""
    return tl.load(X + rows * HV + i_hv, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _raw(X, rows, cols, mask, i_head, NH: tl.constexpr, D: tl.constexpr, EMU: tl.constexpr):
    """``X[rows, i_head, cols]`` of a ``[R, NH, D]`` array in its own dtype (a dot operand as stored; float32
    holding its values when ``EMU``), masked elements 0. ``rows``/``cols`` broadcast as for ``tile``."""
    x = tl.load(X + (rows * NH + i_head) * D + cols, mask=mask, other=0.0)
    if EMU:
        x = x.to(tl.float32)
    return x


@triton.jit
def _dot(a, b, acc, DOT: tl.constexpr, EMU: tl.constexpr, PREC: tl.constexpr):
    """``acc + a @ b`` (float32 accumulation; no ``acc``: ``a @ b``) with both operands rounded to ``DOT``
    (``"bf16"``, or ``"fp32"``: float32 operands at ``PREC``); see :func:`ejkernel_triton._chunk_kernels.rnd`."""
    return tl.dot(rnd(a, DOT, EMU), rnd(b, DOT, EMU), acc, input_precision=PREC)


@triton.jit
def _unit_lower_inverse(b_a, BT: tl.constexpr, TPREC: tl.constexpr):
    """``(I + A)^-1`` of a strictly lower triangular float32 ``[BT, BT]`` tile ``A``, by recursive blocked
    inversion on the whole tile: ``T`` holds the inverses of the diagonal blocks of size ``s`` (which are the
    inverse's own diagonal blocks, so no entry outgrows the inverse's), and each level doubles ``s`` with
    ``T <- T - T N T``, ``N`` being ``A`` masked to the lower off-diagonal ``s``-block of every ``2s``-block
    (``[[T1, 0], [-T2 A21 T1, T2]]``). ``2 log2(BT) - 2`` float32 dots at ``TPREC`` (blocks of 1 and 2 need none),
    no row loop; products of strictly lower tiles are exactly strictly lower, so the result is exactly unit lower
    triangular. (The product form ``(I - A)(I + A^2)(I + A^4)...``, as many dots, is unstable: for near-equal keys
    the powers of ``A`` grow like binomial coefficients and cancel.)"""
    o_t = tl.arange(0, BT)
    r, c = o_t[:, None], o_t[None, :]
    b_t = tl.where(r == c, 1.0, tl.where((r // 2 == c // 2) & (r > c), -b_a, 0.0))  # blocks of 2
    for lv in tl.static_range(1, 10):
        if (1 << lv) < BT:
            off = (r // (2 << lv) == c // (2 << lv)) & ((r >> lv) % 2 == 1) & ((c >> lv) % 2 == 0)
            b_x = tl.dot(tl.where(off, -b_a, 0.0), b_t, input_precision=TPREC)  # -N T
            b_t = tl.dot(b_t, b_x, b_t, input_precision=TPREC)  # T - T N T
    return b_t


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
    TM,
    H: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    STORE_T: tl.constexpr,
    DOT: tl.constexpr,
    EMU: tl.constexpr,
    PREC: tl.constexpr,
    TPREC: tl.constexpr,
):
    """``b``, ``w`` (in ``W``'s dtype), ``u`` (in ``U``'s dtype) of one chunk and value head, and ``T`` (``TM``)
    when ``STORE_T``. Grid ``(NT, HV)``."""
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
    b_k = _raw(K_, rows[:, None], o_k[None, :], m_t[:, None] & m_k[None, :], i_h, H, DK, EMU)  # [BT, BK]
    b_kT = _raw(K_, rows[None, :], o_k[:, None], m_k[:, None] & m_t[None, :], i_h, H, DK, EMU)  # [BK, BT]
    lower = o_t[:, None] > o_t[None, :]
    decay = tl.exp(tl.where(lower, b_b[:, None] - b_b[None, :], 0.0))
    b_a = _dot(b_k, b_kT, None, DOT, EMU, PREC) * decay * b_beta[:, None]
    b_a = tl.where(lower, b_a, 0.0)  # [BT, BT], strictly lower

    b_tri = _unit_lower_inverse(b_a, BT, TPREC)  # T = (I + A)^-1
    if STORE_T:  # for the backward (padding rows and columns of T are the identity's)
        tl.store(TM + ((i_t.to(tl.int64) * HV + i_hv) * BT + o_t[:, None]) * BT + o_t[None, :], b_tri)
    # w = T diag(beta exp(b)) K and u = T diag(beta) V: the row factors scale T's columns, the tiles go as loaded.
    b_w = _dot(b_tri * (b_beta * tl.exp(b_b))[None, :], b_k, None, DOT, EMU, PREC)  # [BT, BK]
    tl.store(
        W + (rows[:, None] * HV + i_hv) * DK + o_k[None, :],
        b_w.to(W.dtype.element_ty),
        mask=m_t[:, None] & m_k[None, :],
    )
    tl.store(B + rows * HV + i_hv, b_b, mask=m_t)
    b_tu = rnd(b_tri * b_beta[None, :], DOT, EMU)
    for i_v in range(tl.cdiv(DV, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < DV)[None, :]
        b_v = _raw(V_, rows[:, None], o_v[None, :], m_tv, i_hv, HV, DV, EMU)  # [BT, BV]
        b_u = _dot(b_tu, b_v, None, DOT, EMU, PREC)
        tl.store(U + (rows[:, None] * HV + i_hv) * DV + o_v[None, :], b_u.to(U.dtype.element_ty), mask=m_tv)


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
    DOT: tl.constexpr,
    EMU: tl.constexpr,
    PREC: tl.constexpr,
):
    """``U'`` (``UC``) and the state at each chunk's start (``Hs``), in their arrays' dtypes, and the final
    state (``HT``, float32). The state tile stays float32 in registers; its dots take it rounded to ``DOT``.
    Grid ``(N * cdiv(DV, BV), HV)``."""
    tl.static_assert(BK >= DK, "one key block")
    i_p, i_hv = tl.program_id(0), tl.program_id(1)
    i_n, bos, eos, c0, n_chunks, o_k, o_v = walk_program(i_p, Cu, ChunkOff, DK, DV, BK, BV)
    i_h = i_hv // (HV // H)
    o_t = tl.arange(0, BT)
    m_k = o_k < DK
    m_v = o_v < DV
    m_h = m_k[:, None] & m_v[None, :]
    p_off = o_k[:, None] * DV + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        b_h += tl.load(H0 + (i_n.to(tl.int64) * HV + i_hv) * (DK * DV) + p_off, mask=m_h, other=0.0)
    for i_c in range(n_chunks):
        i_t = c0 + i_c
        tl.store(Hs + (i_t.to(tl.int64) * HV + i_hv) * (DK * DV) + p_off, b_h.to(Hs.dtype.element_ty), mask=m_h)
        start = bos + i_c * BT
        n_rows = tl.minimum(eos - start, BT)
        rows = start + o_t
        m_t = o_t < n_rows
        m_tv = m_t[:, None] & m_v[None, :]
        b_w = _raw(W, rows[:, None], o_k[None, :], m_t[:, None] & m_k[None, :], i_hv, HV, DK, EMU)  # [BT, BK]
        b_u = tile(U, rows[:, None], o_v[None, :], m_tv, i_hv, HV, DV)  # [BT, BV]
        b_uc = b_u - _dot(b_w, b_h, None, DOT, EMU, PREC)  # U' = u - w S
        tl.store(UC + (rows[:, None] * HV + i_hv) * DV + o_v[None, :], b_uc.to(UC.dtype.element_ty), mask=m_tv)
        b_b = _scalar_col(B, rows, m_t, i_hv, HV)
        # the chunk's total log decay: its last row's, one scalar load (not a reduction over the tile, whose
        # cross-warp exchange sat on the sequential walk's every step)
        b_bl = tl.load(B + (start + n_rows - 1) * HV + i_hv).to(tl.float32)
        b_kT = _raw(K_, rows[None, :], o_k[:, None], m_k[:, None] & m_t[None, :], i_h, H, DK, EMU)  # [BK, BT]
        b_uc = b_uc * tl.exp(tl.where(m_t, b_bl - b_b, 0.0))[:, None]
        b_h = _dot(b_kT, b_uc, b_h * tl.exp(b_bl), DOT, EMU, PREC)
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
    DOT: tl.constexpr,
    EMU: tl.constexpr,
    PREC: tl.constexpr,
):
    """``O`` (in its array's dtype) of one chunk, value head and value block. Grid ``(NT * cdiv(DV, BV), HV)``."""
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
    b_q = _raw(Q, rows[:, None], o_k[None, :], m_t[:, None] & m_k[None, :], i_h, H, DK, EMU)  # [BT, BK]
    b_kT = _raw(K_, rows[None, :], o_k[:, None], m_k[:, None] & m_t[None, :], i_h, H, DK, EMU)  # [BK, BT]
    causal = (o_t[:, None] >= o_t[None, :]) & m_t[:, None]
    b_s = _dot(b_q, b_kT, None, DOT, EMU, PREC) * tl.exp(tl.where(causal, b_b[:, None] - b_b[None, :], 0.0))
    b_s = tl.where(causal, b_s, 0.0)  # [BT, BT]
    b_h = tl.load(
        Hs + (i_t.to(tl.int64) * HV + i_hv) * (DK * DV) + o_k[:, None] * DV + o_v[None, :],
        mask=m_k[:, None] & m_v[None, :],
        other=0.0,
    )  # [BK, BV], as stored
    b_uc = tl.load(UC + (rows[:, None] * HV + i_hv) * DV + o_v[None, :], mask=m_tv, other=0.0)  # [BT, BV]
    if EMU:
        b_h, b_uc = b_h.to(tl.float32), b_uc.to(tl.float32)
    b_eb = tl.exp(tl.where(m_t, b_b, 0.0))
    if DOT == "fp32":  # (scaling the product instead made ptxas spill 7.6 KB for sm_90 at three tf32 passes)
        b_o = _dot(b_q * b_eb[:, None], b_h, None, DOT, EMU, PREC)
    else:  # the query tile goes to the dot as loaded
        b_o = _dot(b_q, b_h, None, DOT, EMU, PREC) * b_eb[:, None]
    b_o = _dot(b_s, b_uc, b_o, DOT, EMU, PREC) * scale
    tl.store(O + (rows[:, None] * HV + i_hv) * DV + o_v[None, :], b_o.to(O.dtype.element_ty), mask=m_tv)


# ------------------------------------------------------------------------------------------------
# Backward.
# ------------------------------------------------------------------------------------------------


@triton.jit
def delta_state_bwd(
    Q,
    K_,
    W,
    B,
    DO,
    DHT,
    Cu,
    ChunkOff,
    scale,
    DUC,
    DHE,
    DH0,
    H: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BKC: tl.constexpr,
    BV: tl.constexpr,
    HAS_DHT: tl.constexpr,
    DOT: tl.constexpr,
    EMU: tl.constexpr,
    PREC: tl.constexpr,
):
    """``dU'`` (``DUC``), the state's gradient at each chunk's end (``DHE``) and before the first (``DH0``; the
    final state's cotangent ``DHT`` for an empty sequence), chunks in reverse; in the dtypes of their arrays
    (dots round them to ``DOT`` anyway) but ``DH0`` (float32). ``dU'``'s share that needs no state, ``scale P^T
    dO``, comes from the tiles each step loads anyway (no launch or round trip of its own). The key tiles go to the
    dots as loaded (per-row factors scale the value-sized operand or the product instead), so they need no
    registers of their own. Grid ``(N * cdiv(DV, BV), HV)``."""
    tl.static_assert(BK >= DK, "one key block")
    i_p, i_hv = tl.program_id(0), tl.program_id(1)
    i_n, bos, eos, c0, n_chunks, o_k, o_v = walk_program(i_p, Cu, ChunkOff, DK, DV, BK, BV)
    i_h = i_hv // (HV // H)
    o_t = tl.arange(0, BT)
    m_k = o_k < DK
    m_v = o_v < DV
    m_h = m_k[:, None] & m_v[None, :]
    p_off = o_k[:, None] * DV + o_v[None, :]
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        b_dh += tl.load(DHT + (i_n.to(tl.int64) * HV + i_hv) * (DK * DV) + p_off, mask=m_h, other=0.0)
    for i_r in range(n_chunks):
        i_c = n_chunks - 1 - i_r
        i_t = c0 + i_c
        tl.store(DHE + (i_t.to(tl.int64) * HV + i_hv) * (DK * DV) + p_off, b_dh.to(DHE.dtype.element_ty), mask=m_h)
        start = bos + i_c * BT
        n_rows = tl.minimum(eos - start, BT)
        rows = start + o_t
        m_t = o_t < n_rows
        m_tv = m_t[:, None] & m_v[None, :]
        m_kt = m_k[:, None] & m_t[None, :]
        causal_t = (o_t[None, :] >= o_t[:, None]) & m_t[None, :]
        b_b = _scalar_col(B, rows, m_t, i_hv, HV)
        b_bl = tl.load(B + (start + n_rows - 1) * HV + i_hv).to(tl.float32)  # as in delta_states
        b_k = _raw(K_, rows[:, None], o_k[None, :], m_t[:, None] & m_k[None, :], i_h, H, DK, EMU)  # [BT, BK]
        b_qT = _raw(Q, rows[None, :], o_k[:, None], m_kt, i_h, H, DK, EMU)  # [BK, BT]
        b_wT = _raw(W, rows[None, :], o_k[:, None], m_kt, i_hv, HV, DK, EMU)  # [BK, BT]
        b_do = tile(DO, rows[:, None], o_v[None, :], m_tv, i_hv, HV, DV)  # [BT, BV]
        # P^T, computed as such: [j, i] = k_j . q_i exp(b_i - b_j) for i >= j (needs no state: off dH's chain)
        if DOT == "fp32":  # in key blocks of BKC: the whole tiles' three tf32 passes spilled (ptxas for sm_90)
            b_pt = tl.zeros([BT, BT], dtype=tl.float32)
            for i_kc in tl.static_range(BK // BKC):
                o_kc = i_kc * BKC + tl.arange(0, BKC)
                m_kc = o_kc < DK
                b_kc = _raw(K_, rows[:, None], o_kc[None, :], m_t[:, None] & m_kc[None, :], i_h, H, DK, EMU)
                b_qcT = _raw(Q, rows[None, :], o_kc[:, None], m_kc[:, None] & m_t[None, :], i_h, H, DK, EMU)
                b_pt = _dot(b_kc, b_qcT, b_pt, DOT, EMU, PREC)
        else:
            b_pt = _dot(b_k, b_qT, None, DOT, EMU, PREC)
        b_pt = tl.where(causal_t, b_pt * tl.exp(tl.where(causal_t, b_b[None, :] - b_b[:, None], 0.0)) * scale, 0.0)
        b_el = tl.exp(tl.where(m_t, b_bl - b_b, 0.0))
        b_duc = _dot(b_pt, b_do, _dot(b_k, b_dh, None, DOT, EMU, PREC) * b_el[:, None], DOT, EMU, PREC)  # [BT, BV]
        tl.store(DUC + (rows[:, None] * HV + i_hv) * DV + o_v[None, :], b_duc.to(DUC.dtype.element_ty), mask=m_tv)
        b_dh = _dot(b_qT, b_do * (tl.exp(b_b) * scale)[:, None], b_dh * tl.exp(b_bl), DOT, EMU, PREC)
        b_dh = _dot(b_wT, -b_duc, b_dh, DOT, EMU, PREC)  # U' = u - w S
    tl.store(DH0 + (i_n.to(tl.int64) * HV + i_hv) * (DK * DV) + p_off, b_dh, mask=m_h)


@triton.jit
def delta_bwd_grads(
    Q,
    K_,
    V_,
    Beta,
    B,
    TM,
    Hs,
    UC,
    DUC,
    DO,
    DHE,
    Cu,
    ChunkSeq,
    ChunkOff,
    scale,
    DQ,
    DK_,
    DV_,
    DG,
    DBeta,
    H: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    BKC: tl.constexpr,
    BV: tl.constexpr,
    DOT: tl.constexpr,
    EMU: tl.constexpr,
    PREC: tl.constexpr,
):
    """Every input's gradient of one chunk and value head: ``dv`` (``v``'s dtype) and ``dq``, ``dk`` (per value
    head), ``dg``, ``dbeta`` (float32). First the WY representation's backward, value blocks in turn (so the
    ``[BT, BT]`` sums are whole): ``dvb = T^T dU'``, ``dv``, ``dA`` and ``dP``, each also computed transposed
    (from operands loaded transposed: no dot result is transposed), giving ``D + D^T`` and ``dP^T``; then key
    blocks of ``BKC`` channels in turn, each summing over every value block, with ``T^T dw = -T^T (dU' S^T)``;
    then the row sums (module docstring). Grid ``(NT, HV)``."""
    i_t, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    _, bos, n_rows = chunk_span(Cu, ChunkSeq, ChunkOff, i_t, BT)
    o_t = tl.arange(0, BT)
    m_t = o_t < n_rows
    rows = bos + o_t
    p_tt = (i_t.to(tl.int64) * HV + i_hv) * (BT * BT)

    b_b = _scalar_col(B, rows, m_t, i_hv, HV)
    b_beta = _scalar_col(Beta, rows, m_t, i_hv, HV)
    # Only dots read T: rounded once (half the registers). [j, i] = T[i, j], and T.
    b_tt = rnd(tl.load(TM + p_tt + o_t[None, :] * BT + o_t[:, None]), DOT, EMU)
    b_tm = rnd(tl.load(TM + p_tt + o_t[:, None] * BT + o_t[None, :]), DOT, EMU)
    b_da = tl.zeros([BT, BT], dtype=tl.float32)  # dvb U'^T = -dA (not yet masked)
    b_daT = tl.zeros([BT, BT], dtype=tl.float32)  # its transpose, U' dvb^T
    b_dp = tl.zeros([BT, BT], dtype=tl.float32)  # dO U'^T
    b_dpT = tl.zeros([BT, BT], dtype=tl.float32)  # U' dO^T
    b_dbeta = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(tl.cdiv(DV, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < DV
        m_tv = m_t[:, None] & m_v[None, :]
        m_vt = m_v[:, None] & m_t[None, :]
        p_tv = (rows[:, None] * HV + i_hv) * DV + o_v[None, :]
        b_duc = _raw(DUC, rows[:, None], o_v[None, :], m_tv, i_hv, HV, DV, EMU)  # [BT, BV]
        b_ducT = _raw(DUC, rows[None, :], o_v[:, None], m_vt, i_hv, HV, DV, EMU)  # [BV, BT]
        b_do = _raw(DO, rows[:, None], o_v[None, :], m_tv, i_hv, HV, DV, EMU)
        b_doT = _raw(DO, rows[None, :], o_v[:, None], m_vt, i_hv, HV, DV, EMU)
        b_uc = _raw(UC, rows[:, None], o_v[None, :], m_tv, i_hv, HV, DV, EMU)
        b_ucT = _raw(UC, rows[None, :], o_v[:, None], m_vt, i_hv, HV, DV, EMU)
        b_v = tile(V_, rows[:, None], o_v[None, :], m_tv, i_hv, HV, DV)
        b_dvb = _dot(b_tt, b_duc, None, DOT, EMU, PREC)  # the gradient of beta V
        tl.store(DV_ + p_tv, (b_dvb * b_beta[:, None]).to(DV_.dtype.element_ty), mask=m_tv)
        b_dbeta += tl.sum(b_dvb * b_v, axis=1)
        b_da = _dot(b_dvb, b_ucT, b_da, DOT, EMU, PREC)
        b_daT = _dot(b_uc, _dot(b_ducT, b_tm, None, DOT, EMU, PREC), b_daT, DOT, EMU, PREC)  # dvb^T = dU'^T T
        b_dp = _dot(b_do, b_ucT, b_dp, DOT, EMU, PREC)
        b_dpT = _dot(b_uc, b_doT, b_dpT, DOT, EMU, PREC)

    b_ge = tl.zeros([BT, BT], dtype=tl.float32)  # K K^T, summed over key blocks
    for i_k in range(tl.cdiv(DK, BKC)):
        o_k = i_k * BKC + tl.arange(0, BKC)
        m_k = o_k < DK
        b_k = _raw(K_, rows[:, None], o_k[None, :], m_t[:, None] & m_k[None, :], i_h, H, DK, EMU)  # [BT, BKC]
        b_kT = _raw(K_, rows[None, :], o_k[:, None], m_k[:, None] & m_t[None, :], i_h, H, DK, EMU)  # [BKC, BT]
        b_ge = _dot(b_k, b_kT, b_ge, DOT, EMU, PREC)
    causal = (o_t[:, None] >= o_t[None, :]) & m_t[:, None]
    causal_t = (o_t[None, :] >= o_t[:, None]) & m_t[None, :]
    b_e = tl.exp(tl.where(causal, b_b[:, None] - b_b[None, :], 0.0))  # exp(b_i - b_j), j <= i (masked below)
    b_eT = tl.exp(tl.where(causal_t, b_b[None, :] - b_b[:, None], 0.0))  # [i, j] = exp(b_j - b_i), i <= j
    b_ge = b_ge * b_e  # A = beta_i * this, below the diagonal
    b_da = tl.where(o_t[:, None] > o_t[None, :], -b_da, 0.0)  # dA
    b_dbeta += tl.sum(b_da * b_ge, axis=1)
    b_y = b_da * b_ge * b_beta[:, None]  # dA * A: b_i's share (row sums) and b_j's (column sums)
    b_db = tl.sum(b_y, axis=1) - tl.sum(b_y, axis=0)
    # D + D^T (D = dA * beta_i exp(b_i - b_j)): A's factor k_i . k_j, both ways
    b_dd = b_da * b_e * b_beta[:, None] + tl.where(o_t[:, None] < o_t[None, :], -b_daT, 0.0) * b_eT * b_beta[None, :]
    b_dpT = tl.where(causal_t, b_dpT * b_eT * scale, 0.0)  # [j, i] = dP[i, j]
    b_dp = tl.where(causal, b_dp * b_e * scale, 0.0)  # dP = scale dO U'^T * exp(b_i - b_j)
    # Only dots read these from here on: rounded once, they hold half the registers through the key blocks.
    b_dd, b_dp, b_dpT = rnd(b_dd, DOT, EMU), rnd(b_dp, DOT, EMU), rnd(b_dpT, DOT, EMU)

    b_bl = tl.sum(tl.where(o_t == n_rows - 1, b_b, 0.0), axis=0)
    b_eb = tl.exp(b_b)
    b_el = tl.exp(tl.where(m_t, b_bl - b_b, 0.0))
    b_kw = b_beta * b_eb  # w's row factor beta exp(b)
    b_hdh = 0.0  # sum(S * dH)
    b_kdks = 0.0  # sum(K * (U' dH^T) * exp(b_L - b))
    for i_k in range(tl.cdiv(DK, BKC)):
        o_k = i_k * BKC + tl.arange(0, BKC)
        m_k = o_k < DK
        m_tk = m_t[:, None] & m_k[None, :]
        b_dq = tl.zeros([BT, BKC], dtype=tl.float32)  # dO S^T
        b_dks = tl.zeros([BT, BKC], dtype=tl.float32)  # U' dH^T
        b_dus = tl.zeros([BT, BKC], dtype=tl.float32)  # dU' S^T (T^T dw = -T^T this)
        b_hdh_k = tl.zeros([BKC], dtype=tl.float32)
        for i_v in range(tl.cdiv(DV, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_v = o_v < DV
            m_tv = m_t[:, None] & m_v[None, :]
            b_do = _raw(DO, rows[:, None], o_v[None, :], m_tv, i_hv, HV, DV, EMU)  # [BT, BV]
            b_uc = _raw(UC, rows[:, None], o_v[None, :], m_tv, i_hv, HV, DV, EMU)
            b_duc = _raw(DUC, rows[:, None], o_v[None, :], m_tv, i_hv, HV, DV, EMU)
            b_hT = state_at(Hs, i_t, i_hv, o_k[None, :], o_v[:, None], m_k[None, :], m_v[:, None], HV, DK, DV)
            b_dhT = state_at(DHE, i_t, i_hv, o_k[None, :], o_v[:, None], m_k[None, :], m_v[:, None], HV, DK, DV)
            b_dq = _dot(b_do, b_hT, b_dq, DOT, EMU, PREC)
            b_dks = _dot(b_uc, b_dhT, b_dks, DOT, EMU, PREC)
            b_dus = _dot(b_duc, b_hT, b_dus, DOT, EMU, PREC)
            b_hdh_k += tl.sum(b_hT.to(tl.float32) * b_dhT.to(tl.float32), axis=0)
        b_dkw = _dot(b_tt, b_dus, None, DOT, EMU, PREC)  # dvb S^T = -(T^T dw)
        b_q = tile(Q, rows[:, None], o_k[None, :], m_tk, i_h, H, DK)  # [BT, BKC]
        b_k = tile(K_, rows[:, None], o_k[None, :], m_tk, i_h, H, DK)
        b_dq = _dot(b_dp, b_k, b_dq * (b_eb * scale)[:, None], DOT, EMU, PREC)
        b_dkp = _dot(b_dpT, b_q, None, DOT, EMU, PREC)  # the keys' share of the output's scores
        b_dks = b_dks * b_el[:, None]  # ... and of the state at the chunk's end
        b_dk = _dot(b_dd, b_k, b_dkp + b_dks - b_dkw * b_kw[:, None], DOT, EMU, PREC)
        b_kdkw = tl.sum(b_k * b_dkw, axis=1)  # k . (T^T dw), negated
        b_dbeta -= b_eb * b_kdkw
        b_kdks_k = tl.sum(b_k * b_dks, axis=1)
        b_db += tl.sum(b_q * b_dq, axis=1) - tl.sum(b_k * b_dkp, axis=1) - b_kdks_k - b_kw * b_kdkw
        b_kdks += tl.sum(b_kdks_k, axis=0)
        b_hdh += tl.sum(b_hdh_k, axis=0)
        p_x = (rows[:, None] * HV + i_hv) * DK + o_k[None, :]
        tl.store(DQ + p_x, b_dq, mask=m_tk)
        tl.store(DK_ + p_x, b_dk, mask=m_tk)
    # b_L scales the state entering the chunk and every key's share of the state leaving it.
    b_db += tl.where(o_t == n_rows - 1, tl.exp(b_bl) * b_hdh + b_kdks, 0.0)
    tl.store(DG + rows * HV + i_hv, tl.cumsum(b_db, axis=0, reverse=True), mask=m_t)
    tl.store(DBeta + rows * HV + i_hv, b_dbeta, mask=m_t)
