"""The chunked kernels of linear attention with a log decay per token, head and value channel (``value_gla``),
forward and backward.

Per sequence and head the recurrence ``S_t = S_{t-1} diag(exp(gv_t)) + k_t^T v_t``, ``o_t = scale q_t S_t``
(``gv [R, H, DV]``) is cut into chunks of ``BT`` tokens. With ``b`` the cumulative log decay from the chunk's
start (``[BT, DV]``, token included; masked rows add 0, so they read the chunk's total ``b_L``), a chunk entered
with state ``S`` gives (``*``: elementwise over the value channels)::

    o_i    = scale (exp(b_i) * (q_i S)  +  sum_{j <= i} (q_i . k_j) exp(b_i - b_j) * v_j)
    S_next = S diag(exp(b_L))  +  k^T (v * exp(b_L - b))

Each value channel is a scalar-decay recurrence of its own, so the decays ride on the value side of every product:
the inter-chunk ones are row factors after ``q @ h``, ``k @ dhe``, ``do @ h^T``, ``v @ dhe^T``, or on the rows of
the state passes' value-side operand. The intra-chunk pairs ``j <= i`` go by blocks of ``BC = 16`` rows (one
dot's smallest side): a pair of blocks ``I > J`` splits ``exp(b_i - b_j) = exp(b_i - b_r) exp(b_r - b_j)`` at a
reference row ``r`` between them (the first of ``I``; the last of ``J`` for ``dv``), both exponents ``<= 0``, so
it is one product ``(q_I k_J^T) @ (v_J * exp(b_r - b_J))``; the pairs inside a block are ``BC`` rank-1 updates
with the exponent masked (``j > i`` to ``-inf``) before the ``exp`` (:func:`diag_rows`, :func:`diag_pairs`). No
exponent is ever positive.

Kernels (the forward: the cumulative decays, the states, :func:`value_output`; the backward recomputes the first
two at float32 accuracy, then the state's gradient and the rest). The state passes are the chunked ``gla``'s
(``ejkernel_triton._chunk_kernels``) on the transposed state ``S^T [V, K]``, whose decay is on its rows:
``S^T <- diag(exp(b_L)) S^T + (v exp(b_L - b))^T k`` (keys and values swapped), and its gradient's reverse pass
with ``q`` and ``do`` swapped; so the states ``h``, ``dhe`` are ``[NT, H, DV, DK]`` here, read transposed.

* ``chunk_gate_cumsum``: ``b`` (float32, ``[R, H, DV]``);
* ``chunk_state_fwd``: ``h^T`` at each chunk's start, and the final state;
* :func:`value_output`: ``o`` per (chunk, value tile), block by block;
* ``chunk_state_bwd``: ``dhe^T`` (the state's gradient at each chunk's end) and the initial state's;
* :func:`value_pairs`: per (chunk, head), the chunk's pair matrices once, ``A = scale q k^T`` and
  ``D_ij = sum_c do_ic v_jc exp(b_ic - b_jc)`` (``j <= i``; ``[NT, H, BT, BT]`` float32 each);
* :func:`value_dv`: ``dv`` and the decay's gradient ``dgv`` per (chunk, value tile), reading ``A`` (it says how);
* :func:`value_dqk`: ``dq = scale (D @ k + ...)``, ``dk = scale D^T @ q + ...`` per (chunk, key tile), reading
  ``D``.

With a key gate too (``HAS_GK``; ``recurrent`` with ``g_k`` and ``g_v``, ``S_t = diag(exp(a_t)) S_{t-1}
diag(exp(gv_t)) + k_t^T v_t``, ``a`` the key side's cumulative gates ``GC [R, H, DK]``): the key side's decays are
what the chunked ``gla``'s kernels apply, so its kernels take that side: ``A`` becomes its key-decayed scores
``A_ij = scale sum_c q_ic k_jc exp(a_ic - a_jc)`` (``chunk_intra_diag``/``chunk_intra_offdiag``, float32), read by
:func:`value_output` and :func:`value_dv` in place of ``scale q k^T`` (the value side's ``exp(b_i - b_j)`` goes on
as before: the two factor apart); ``q @ h`` reads ``q exp(a)``, ``k @ dhe`` reads ``k exp(a_L - a)``, and the
state passes decay the key side too (their ``HAS_GV``, the transposed state's columns). :func:`value_pairs` then
writes only ``scale D``, the scores' gradient, and ``dq``, ``dk`` with the key gate's gradient are the chunked
``gla``'s ``chunk_dqk_intra`` and ``chunk_dqk_inter`` (with its ``HAS_GV``), not :func:`value_dqk`.

Layouts as ``ejkernel_triton._simple_chunk_kernels``' (``q``, ``k [R, H, DK]``; ``v``, ``do``, ``b [R, H, DV]``;
the chunk table ``Cu``, ``ChunkOff``, ``ChunkSeq``), the states transposed (``[NT, H, DV, DK]``). Dots
(:func:`mm`): operands in ``DOT``, float32 accumulation; products that feed the float32 results (the states,
``dgv``) split their float32 operands (``SA``/``SB``). Dot results are never transposed (Triton 3.6 on Hopper
miscompiles ``tl.trans`` of one): transposed operands (``A^T``, ``D^T`` too) are loaded transposed.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ejkernel_triton import launch as _launch  # noqa: F401  (the interpreter switch, before any @triton.jit)
from ejkernel_triton._chunk_kernels import chunk_span, exclusive_cumsum, gate, mm, raw, state_at, tile

# ------------------------------------------------------------------------------------------------
# Helpers.
# ------------------------------------------------------------------------------------------------


@triton.jit
def chunk_total(B, bos, n_rows, o_v, m_v, i_h, H: tl.constexpr, DV: tl.constexpr):
    """``b_L [BV]``: the cumulative decay at the chunk's last valid row (0 for an empty chunk)."""
    last = bos + tl.maximum(n_rows - 1, 0)
    return tl.load(B + (last * H + i_h) * DV + o_v, mask=m_v & (tl.zeros_like(o_v) < n_rows), other=0.0)


@triton.jit
def gates(B, rows, o_v, m_t, m_v, b_l, i_h, H: tl.constexpr, DV: tl.constexpr, TRANS: tl.constexpr):
    """``b`` of ``rows`` (``[len(rows), BV]``; ``TRANS``: ``[BV, len(rows)]``), masked rows ``b_L``."""
    if TRANS:
        b = tile(B, rows[None, :], o_v[:, None], m_v[:, None] & m_t[None, :], i_h, H, DV)
        b = tl.where(m_t[None, :], b, b_l[:, None])
    else:
        b = tile(B, rows[:, None], o_v[None, :], m_t[:, None] & m_v[None, :], i_h, H, DV)
        b = tl.where(m_t[:, None], b, b_l[None, :])
    return b


@triton.jit
def gate_row(B, bos, r, n_rows, b_l, o_v, m_v, i_h, H: tl.constexpr, DV: tl.constexpr):
    """``b [BV]`` of the chunk's row ``r`` (``b_L`` past its ``n_rows``)."""
    valid = (tl.zeros_like(o_v) + r) < n_rows
    b = tl.load(B + ((bos + r) * H + i_h) * DV + o_v, mask=m_v & valid, other=0.0)
    return tl.where(valid, b, b_l)


@triton.jit
def scores(X, Y, rows_x, rows_y, m_x, m_y, i_h, H: tl.constexpr, DK: tl.constexpr, BK: tl.constexpr,
           BC: tl.constexpr, DOT: tl.constexpr, EMU: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """``X[rows_x] @ Y[rows_y]^T`` over all key tiles (``[BC, BC]`` float32; exact operands)."""
    acc = tl.zeros([BC, BC], dtype=tl.float32)
    for i_k in range(tl.cdiv(DK, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < DK
        x = raw(X, rows_x[:, None], o_k[None, :], m_x[:, None] & m_k[None, :], i_h, H, DK, EMU)
        yT = raw(Y, rows_y[None, :], o_k[:, None], m_k[:, None] & m_y[None, :], i_h, H, DK, EMU)
        acc = mm(x, yT, acc, 0, 0, DOT, EMU, PREC)
    return acc


@triton.jit
def diag_rows(a, X, B, bos, r0, n_rows, b, b_l, o_v, m_v, i_h, H: tl.constexpr, DV: tl.constexpr,
              BC: tl.constexpr, UP: tl.constexpr, DIAG: tl.constexpr):  # fmt: skip
    """The pairs inside one block (rows ``r0 + [0, BC)``, ``b`` theirs ``[BC, BV]``), one column at a time::

        out[x] = sum_y a[x, y] exp(b_x - b_y) * X_y   over y < x          (UP: exp(b_y - b_x), over y > x)

    plus ``y == x`` when ``DIAG``; the exponent is masked before the ``exp``. ``[BC, BV]`` float32."""
    o_c = tl.arange(0, BC)
    out = tl.zeros([BC, b.shape[1]], dtype=tl.float32)
    for y in range(BC):
        valid = (tl.zeros_like(o_v) + r0 + y) < n_rows
        x_y = tl.load(X + ((bos + r0 + y) * H + i_h) * DV + o_v, mask=m_v & valid, other=0.0).to(tl.float32)
        b_y = gate_row(B, bos, r0 + y, n_rows, b_l, o_v, m_v, i_h, H, DV)
        a_y = tl.sum(tl.where(o_c[None, :] == y, a, 0.0), axis=1)  # [BC]: column y
        if UP:
            m = o_c < y
            d = b_y[None, :] - b
        else:
            m = o_c > y
            d = b - b_y[None, :]
        if DIAG:
            m = m | (o_c == y)
        out += (a_y[:, None] * tl.exp(tl.where(m[:, None], d, float("-inf")))) * x_y[None, :]
    return out


@triton.jit
def diag_pairs(DO, V_, B, bos, r0, n_rows, rows, m_t, i_h, H: tl.constexpr, DV: tl.constexpr,
               BV: tl.constexpr, BC: tl.constexpr, TRANS: tl.constexpr):  # fmt: skip
    """``D[i, j] = sum_c do_ic v_jc exp(b_ic - b_jc)`` over ``j <= i`` of one block, all value tiles (``[BC, BC]``
    float32; ``TRANS``: ``[j, i]``)."""
    o_c = tl.arange(0, BC)
    out = tl.zeros([BC, BC], dtype=tl.float32)
    for i_v in range(tl.cdiv(DV, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < DV
        b_lv = chunk_total(B, bos, n_rows, o_v, m_v, i_h, H, DV)
        b = gates(B, rows, o_v, m_t, m_v, b_lv, i_h, H, DV, False)
        b_do = tile(DO, rows[:, None], o_v[None, :], m_t[:, None] & m_v[None, :], i_h, H, DV)
        for j in range(BC):
            valid = (tl.zeros_like(o_v) + r0 + j) < n_rows
            v_j = tl.load(V_ + ((bos + r0 + j) * H + i_h) * DV + o_v, mask=m_v & valid, other=0.0).to(tl.float32)
            b_j = gate_row(B, bos, r0 + j, n_rows, b_lv, o_v, m_v, i_h, H, DV)
            e = tl.exp(tl.where((o_c >= j)[:, None], b - b_j[None, :], float("-inf")))
            col = tl.sum(b_do * e * v_j[None, :], axis=1)  # [BC] over i
            if TRANS:
                out += tl.where(o_c[:, None] == j, col[None, :], 0.0)
            else:
                out += tl.where(o_c[None, :] == j, col[:, None], 0.0)
    return out


@triton.jit
def cross_pairs(X, Y, B, rows_x, rows_y, m_x, m_y, ref, bos, n_rows, i_h, H: tl.constexpr,
                DV: tl.constexpr, BV: tl.constexpr, BC: tl.constexpr, LATE_X: tl.constexpr, DOT: tl.constexpr,
                EMU: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """``sum_c X_xc Y_yc exp(b_xc - b_yc)`` (``LATE_X``; else ``exp(b_yc - b_xc)``) for blocks ``x``, ``y``
    apart, all value tiles, split at the reference row ``ref`` between them (both factors ``<= 0``): ``[BC, BC]``
    float32 (both operands split)."""
    acc = tl.zeros([BC, BC], dtype=tl.float32)
    for i_v in range(tl.cdiv(DV, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < DV
        b_lv = chunk_total(B, bos, n_rows, o_v, m_v, i_h, H, DV)
        b_r = gate_row(B, bos, ref, n_rows, b_lv, o_v, m_v, i_h, H, DV)
        b_x = gates(B, rows_x, o_v, m_x, m_v, b_lv, i_h, H, DV, False)
        b_yT = gates(B, rows_y, o_v, m_y, m_v, b_lv, i_h, H, DV, True)
        x = tile(X, rows_x[:, None], o_v[None, :], m_x[:, None] & m_v[None, :], i_h, H, DV)
        yT = tile(Y, rows_y[None, :], o_v[:, None], m_v[:, None] & m_y[None, :], i_h, H, DV)
        if LATE_X:
            x = x * tl.exp(b_x - b_r[None, :])
            yT = yT * tl.exp(b_r[:, None] - b_yT)
        else:
            x = x * tl.exp(b_r[None, :] - b_x)
            yT = yT * tl.exp(b_yT - b_r[:, None])
        acc = mm(x, yT, acc, 1, 1, DOT, EMU, PREC)
    return acc


@triton.jit
def key_factors(GC, rows, o_k, m_tk, bos, n_rows, m_k, i_h, H: tl.constexpr, DK: tl.constexpr):
    """``(exp(a), exp(a_L - a))`` (``[len(rows), BK]``), the factors of ``q`` and ``k`` for a key gate with the
    value gate, ``a`` the key side's cumulative gates ``GC [R, H, DK]`` (masked rows read 0: exponents <= 0)."""
    b_a = gate(GC, rows[:, None], o_k[None, :], m_tk, i_h, H, DK)
    b_al = gate(GC, bos + n_rows - 1, o_k, m_k & (o_k * 0 < n_rows), i_h, H, DK)  # [BK]
    return tl.exp(b_a), tl.exp(b_al[None, :] - b_a)


# ------------------------------------------------------------------------------------------------
# Per chunk.
# ------------------------------------------------------------------------------------------------


@triton.jit
def value_output(
    Q,
    K_,
    V_,
    B,
    Hs,
    GC,
    A,
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
    BC: tl.constexpr,
    HAS_GK: tl.constexpr,
    PREC: tl.constexpr,
    DOT: tl.constexpr,
    EMU: tl.constexpr,
):
    """``o`` of one chunk and value tile, block ``I`` of ``BC`` rows at a time (``r`` its first row)::

        o_I = scale (exp(b_I) * (q_I @ h) + exp(b_I - b_r) * sum_{J < I} (q_I @ k_J^T) @ (v_J exp(b_r - b_J))
                     + the pairs inside I)

    ``HAS_GK`` (a key gate too): ``q`` reads ``q exp(a)`` (``a = GC [R, H, DK]``, the key side's cumulative gates)
    and the scores ``scale q_I @ k_J^T`` are the key-decayed ones of the chunked ``gla``'s intra kernels, read
    from ``A [NT, H, BT, BT]`` (scale included). Grid ``(NT * cdiv(DV, BV), H)``."""
    NV: tl.constexpr = (DV + BV - 1) // BV
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    i_t = i_p // NV
    i_v = i_p % NV
    _, bos, n_rows = chunk_span(Cu, ChunkSeq, ChunkOff, i_t, BT)
    o_c = tl.arange(0, BC)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < DV
    b_l = chunk_total(B, bos, n_rows, o_v, m_v, i_h, H, DV)
    base = (i_t.to(tl.int64) * H + i_h) * (BT * BT)  # this chunk's scores in A (HAS_GK)
    for i_b in range(tl.cdiv(n_rows, BC)):
        r0 = i_b * BC
        rows = bos + r0 + o_c
        m_t = r0 + o_c < n_rows
        b = gates(B, rows, o_v, m_t, m_v, b_l, i_h, H, DV, False)
        b_r = gate_row(B, bos, r0, n_rows, b_l, o_v, m_v, i_h, H, DV)
        b_qh = tl.zeros([BC, BV], dtype=tl.float32)
        for i_k in range(tl.cdiv(DK, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < DK
            m_tk = m_t[:, None] & m_k[None, :]
            b_q = raw(Q, rows[:, None], o_k[None, :], m_tk, i_h, H, DK, EMU)
            if HAS_GK:
                b_q = b_q.to(tl.float32) * tl.exp(gate(GC, rows[:, None], o_k[None, :], m_tk, i_h, H, DK))
            b_h = state_at(Hs, i_t, i_h, o_v[None, :], o_k[:, None], m_v[None, :], m_k[:, None], H, DV, DK)
            b_qh = mm(b_q, b_h, b_qh, 0, 0, DOT, EMU, PREC)
        o_scale = scale
        if HAS_GK:  # the scores read from A carry the scale: only the state's term takes it here
            b_qh = b_qh * scale
            o_scale = 1.0
        b_x = tl.zeros([BC, BV], dtype=tl.float32)
        for j_b in range(i_b):
            rows_j = bos + j_b * BC + o_c
            m_j = o_c >= 0
            if HAS_GK:
                b_a = tl.load(A + base + (r0 + o_c)[:, None] * BT + (j_b * BC + o_c)[None, :]).to(tl.float32)
            else:
                b_a = scores(Q, K_, rows, rows_j, m_t, m_j, i_h, H, DK, BK, BC, DOT, EMU, PREC)
            b_j = gates(B, rows_j, o_v, m_j, m_v, b_l, i_h, H, DV, False)
            b_vj = tile(V_, rows_j[:, None], o_v[None, :], m_j[:, None] & m_v[None, :], i_h, H, DV)
            b_x = mm(b_a, b_vj * tl.exp(b_r[None, :] - b_j), b_x, 0, 0, DOT, EMU, PREC)
        if HAS_GK:
            b_a = tl.load(A + base + (r0 + o_c)[:, None] * BT + (r0 + o_c)[None, :]).to(tl.float32)
        else:
            b_a = scores(Q, K_, rows, rows, m_t, m_t, i_h, H, DK, BK, BC, DOT, EMU, PREC)
        b_o = tl.exp(b) * b_qh + tl.exp(b - b_r[None, :]) * b_x
        b_o += diag_rows(b_a, V_, B, bos, r0, n_rows, b, b_l, o_v, m_v, i_h, H, DV, BC, False, True)
        m_tv = m_t[:, None] & m_v[None, :]
        tl.store(O + (rows[:, None] * H + i_h) * DV + o_v[None, :], (b_o * o_scale).to(O.dtype.element_ty), mask=m_tv)


@triton.jit
def value_dv(
    Q,
    K_,
    V_,
    B,
    GC,
    DO,
    Hs,
    DHE,
    A,
    Cu,
    ChunkSeq,
    ChunkOff,
    scale,
    DV_,
    DGU,
    DGW,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BC: tl.constexpr,
    HAS_GK: tl.constexpr,
    PREC: tl.constexpr,
    DOT: tl.constexpr,
    EMU: tl.constexpr,
):
    """``dv`` and the decay's gradient (``DGU + DGW``, float32) of one chunk and value tile, block ``J`` of ``BC``
    rows at a time, in reverse (``e`` its last row), the score blocks read from :func:`value_pairs`' ``A``
    (``A_IJ^T`` loaded transposed)::

        dv_J = exp(b_e - b_J) * sum_{I > J} A_IJ^T @ (do_I exp(b_I - b_e)) + pairs inside J
               + exp(b_L - b_J) * (k_J @ dhe)

    The decay's gradient, per row ``t`` and channel (``h`` the state at the chunk's start, ``dhe`` its gradient
    at the chunk's end; ``o'``, ``dv'`` the intra-chunk parts of ``o``, ``dv`` over the pairs ``i != j`` only)::

        dgv_t = sum_{s >= t} u_s  +  sum_{s < t} w_s  +  exp(b_L) sum_k h * dhe
        u = do * (scale exp(b) (q @ h) + o') - v * dv',    w = v exp(b_L - b) (k @ dhe)

    (``u``: what ``b_t`` does to the chunk's outputs, ``w``: what ``b_L - b_t`` does to the state it passes on).
    The pairs ``i == j`` give ``do_i o_i`` and ``v_i dv_i`` the same term, which cancels exactly: left out (its
    rounding would swamp the crossing pairs' terms under strong decay). ``DGU`` gets the first sum (this reverse
    pass), ``DGW`` the rest (a second, forward pass). ``HAS_GK`` (a key gate too; ``a = GC [R, H, DK]`` its
    cumulative gates, ``A`` the key-decayed scores of the chunked ``gla``'s intra kernels): ``q`` reads ``q
    exp(a)``, ``k`` reads ``k exp(a_L - a)`` and ``sum_k h * dhe`` weighs each key row by ``exp(a_L)`` (the
    state's decay is ``diag(exp(a_L)) S diag(exp(b_L))``). Grid ``(NT * cdiv(DV, BV), H)``."""
    NV: tl.constexpr = (DV + BV - 1) // BV
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    i_t = i_p // NV
    i_v = i_p % NV
    _, bos, n_rows = chunk_span(Cu, ChunkSeq, ChunkOff, i_t, BT)
    o_c = tl.arange(0, BC)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < DV
    b_l = chunk_total(B, bos, n_rows, o_v, m_v, i_h, H, DV)
    base = (i_t.to(tl.int64) * H + i_h) * (BT * BT)
    n_b = tl.cdiv(n_rows, BC)
    b_su = tl.zeros([BV], dtype=tl.float32)
    for i_r in range(n_b):
        i_b = n_b - 1 - i_r
        r0 = i_b * BC
        rows = bos + r0 + o_c
        m_t = r0 + o_c < n_rows
        m_tv = m_t[:, None] & m_v[None, :]
        b = gates(B, rows, o_v, m_t, m_v, b_l, i_h, H, DV, False)
        b_r = gate_row(B, bos, r0, n_rows, b_l, o_v, m_v, i_h, H, DV)
        b_e = gate_row(B, bos, r0 + BC - 1, n_rows, b_l, o_v, m_v, i_h, H, DV)
        b_qh = tl.zeros([BC, BV], dtype=tl.float32)
        b_kd = tl.zeros([BC, BV], dtype=tl.float32)
        for i_k in range(tl.cdiv(DK, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < DK
            m_tk = m_t[:, None] & m_k[None, :]
            b_q = raw(Q, rows[:, None], o_k[None, :], m_tk, i_h, H, DK, EMU)
            b_k = raw(K_, rows[:, None], o_k[None, :], m_tk, i_h, H, DK, EMU)
            if HAS_GK:
                e_q, e_k = key_factors(GC, rows, o_k, m_tk, bos, n_rows, m_k, i_h, H, DK)
                b_q = b_q.to(tl.float32) * e_q
                b_k = b_k.to(tl.float32) * e_k
            b_h = state_at(Hs, i_t, i_h, o_v[None, :], o_k[:, None], m_v[None, :], m_k[:, None], H, DV, DK)
            b_dhe = state_at(DHE, i_t, i_h, o_v[None, :], o_k[:, None], m_v[None, :], m_k[:, None], H, DV, DK)
            b_qh = mm(b_q, b_h, b_qh, HAS_GK, 1, DOT, EMU, PREC)
            b_kd = mm(b_k, b_dhe, b_kd, HAS_GK, 1, DOT, EMU, PREC)
        b_x = tl.zeros([BC, BV], dtype=tl.float32)  # the output's earlier blocks, at r
        for j_b in range(i_b):
            rows_j = bos + j_b * BC + o_c
            m_j = o_c >= 0
            b_a = tl.load(A + base + (r0 + o_c)[:, None] * BT + (j_b * BC + o_c)[None, :])
            b_j = gates(B, rows_j, o_v, m_j, m_v, b_l, i_h, H, DV, False)
            b_vj = tile(V_, rows_j[:, None], o_v[None, :], m_j[:, None] & m_v[None, :], i_h, H, DV)
            b_x = mm(b_a, b_vj * tl.exp(b_r[None, :] - b_j), b_x, 1, 1, DOT, EMU, PREC)
        b_y = tl.zeros([BC, BV], dtype=tl.float32)  # dv's later blocks, at e
        for i_b2 in range(i_b + 1, n_b):
            rows_i = bos + i_b2 * BC + o_c
            m_i = i_b2 * BC + o_c < n_rows
            b_aT = tl.load(A + base + (i_b2 * BC + o_c)[None, :] * BT + (r0 + o_c)[:, None])  # [j, i]
            b_i = gates(B, rows_i, o_v, m_i, m_v, b_l, i_h, H, DV, False)
            b_doi = tile(DO, rows_i[:, None], o_v[None, :], m_i[:, None] & m_v[None, :], i_h, H, DV)
            b_y = mm(b_aT, b_doi * tl.exp(b_i - b_e[None, :]), b_y, 1, 1, DOT, EMU, PREC)
        b_a = tl.load(A + base + (r0 + o_c)[:, None] * BT + (r0 + o_c)[None, :])
        b_aT = tl.load(A + base + (r0 + o_c)[None, :] * BT + (r0 + o_c)[:, None])
        b_os = tl.exp(b - b_r[None, :]) * b_x
        b_os += diag_rows(b_a, V_, B, bos, r0, n_rows, b, b_l, o_v, m_v, i_h, H, DV, BC, False, False)
        b_dvs = tl.exp(b_e[None, :] - b) * b_y
        b_dvs += diag_rows(b_aT, DO, B, bos, r0, n_rows, b, b_l, o_v, m_v, i_h, H, DV, BC, True, False)
        b_do = tile(DO, rows[:, None], o_v[None, :], m_tv, i_h, H, DV)
        b_v = tile(V_, rows[:, None], o_v[None, :], m_tv, i_h, H, DV)
        b_kq = tl.sum(tl.where(o_c[:, None] == o_c[None, :], b_a, 0.0), axis=1)  # scale q_i . k_i
        b_dv = b_dvs + b_kq[:, None] * b_do + tl.exp(b_l[None, :] - b) * b_kd
        tl.store(DV_ + (rows[:, None] * H + i_h) * DV + o_v[None, :], b_dv.to(DV_.dtype.element_ty), mask=m_tv)
        b_u = b_do * (scale * tl.exp(b) * b_qh + b_os) - b_v * b_dvs
        b_u = tl.where(m_tv, b_u, 0.0)
        tl.store(
            DGU + (rows[:, None] * H + i_h) * DV + o_v[None, :],
            tl.cumsum(b_u, axis=0, reverse=True) + b_su[None, :],
            mask=m_tv,
        )
        b_su += tl.sum(b_u, axis=0)
    # the second pass: sum_{s < t} w_s + exp(b_L) <h, dhe>, forward
    b_hd = tl.zeros([BV], dtype=tl.float32)
    for i_k in range(tl.cdiv(DK, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < DK
        b_h = state_at(Hs, i_t, i_h, o_v[None, :], o_k[:, None], m_v[None, :], m_k[:, None], H, DV, DK)
        b_dhe = state_at(DHE, i_t, i_h, o_v[None, :], o_k[:, None], m_v[None, :], m_k[:, None], H, DV, DK)
        if HAS_GK:
            b_al = gate(GC, bos + n_rows - 1, o_k, m_k & (o_k * 0 < n_rows), i_h, H, DK)  # [BK]
            b_h = b_h * tl.exp(b_al)[:, None]
        b_hd += tl.sum(b_h * b_dhe, axis=0)
    b_sw = tl.exp(b_l) * b_hd
    for i_b in range(n_b):
        r0 = i_b * BC
        rows = bos + r0 + o_c
        m_t = r0 + o_c < n_rows
        m_tv = m_t[:, None] & m_v[None, :]
        b = gates(B, rows, o_v, m_t, m_v, b_l, i_h, H, DV, False)
        b_kd = tl.zeros([BC, BV], dtype=tl.float32)
        for i_k in range(tl.cdiv(DK, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < DK
            m_tk = m_t[:, None] & m_k[None, :]
            b_k = raw(K_, rows[:, None], o_k[None, :], m_tk, i_h, H, DK, EMU)
            if HAS_GK:
                e_q, e_k = key_factors(GC, rows, o_k, m_tk, bos, n_rows, m_k, i_h, H, DK)
                b_k = b_k.to(tl.float32) * e_k
            b_dhe = state_at(DHE, i_t, i_h, o_v[None, :], o_k[:, None], m_v[None, :], m_k[:, None], H, DV, DK)
            b_kd = mm(b_k, b_dhe, b_kd, HAS_GK, 1, DOT, EMU, PREC)
        b_v = tile(V_, rows[:, None], o_v[None, :], m_tv, i_h, H, DV)
        b_w = tl.where(m_tv, b_v * tl.exp(b_l[None, :] - b) * b_kd, 0.0)
        if HAS_GK:
            b_ws = exclusive_cumsum(b_w, BC)
        else:
            b_ws = tl.cumsum(b_w, axis=0) - b_w
        tl.store(DGW + (rows[:, None] * H + i_h) * DV + o_v[None, :], b_ws + b_sw[None, :], mask=m_tv)
        b_sw += tl.sum(b_w, axis=0)


@triton.jit
def value_pairs(
    Q,
    K_,
    V_,
    B,
    DO,
    Cu,
    ChunkSeq,
    ChunkOff,
    scale,
    A,
    D,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BC: tl.constexpr,
    HAS_GK: tl.constexpr,
    PREC: tl.constexpr,
    DOT: tl.constexpr,
    EMU: tl.constexpr,
):
    """The pair matrices of one chunk (``[BT, BT]`` float32 each, zero above the diagonal and past the chunk)::

        A_ij = scale q_i . k_j   (j <= i; exact operands, one product over the key tiles)
        D_ij = sum_c do_ic v_jc exp(b_ic - b_jc)   (j <= i; :func:`cross_pairs` for blocks apart, :func:`diag_pairs`
                                                    inside one, over all value tiles)

    ``D`` is written block by block (its buffer zeroed). ``HAS_GK`` (a key gate too: the scores are the chunked
    ``gla``'s, computed apart): ``A`` is not written, and ``D`` is stored times ``scale``, the scores' gradient
    ``dA`` that ``ejkernel_triton._chunk_kernels.chunk_dqk_intra`` reads. Grid ``(NT, H)``."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    _, bos, n_rows = chunk_span(Cu, ChunkSeq, ChunkOff, i_t, BT)
    base = (i_t.to(tl.int64) * H + i_h) * (BT * BT)
    if not HAS_GK:
        o_t = tl.arange(0, BT)
        m_t = o_t < n_rows
        b_a = tl.zeros([BT, BT], dtype=tl.float32)
        for i_k in range(tl.cdiv(DK, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < DK
            b_q = raw(Q, (bos + o_t)[:, None], o_k[None, :], m_t[:, None] & m_k[None, :], i_h, H, DK, EMU)
            b_kT = raw(K_, (bos + o_t)[None, :], o_k[:, None], m_k[:, None] & m_t[None, :], i_h, H, DK, EMU)
            b_a = mm(b_q, b_kT, b_a, 0, 0, DOT, EMU, PREC)
        b_a = tl.where(o_t[:, None] >= o_t[None, :], b_a * scale, 0.0)
        tl.store(A + base + o_t[:, None] * BT + o_t[None, :], b_a)
    o_c = tl.arange(0, BC)
    for i_b in range(tl.cdiv(n_rows, BC)):
        r0 = i_b * BC
        rows = bos + r0 + o_c
        m_i = r0 + o_c < n_rows
        for j_b in range(i_b):
            rows_j = bos + j_b * BC + o_c
            m_j = o_c >= 0
            b_d = cross_pairs(
                DO, V_, B, rows, rows_j, m_i, m_j, r0, bos, n_rows, i_h, H, DV, BV, BC, True, DOT, EMU, PREC
            )
            if HAS_GK:
                b_d = b_d * scale
            tl.store(D + base + (r0 + o_c)[:, None] * BT + (j_b * BC + o_c)[None, :], b_d)
        b_d = diag_pairs(DO, V_, B, bos, r0, n_rows, rows, m_i, i_h, H, DV, BV, BC, False)
        if HAS_GK:
            b_d = b_d * scale
        tl.store(D + base + (r0 + o_c)[:, None] * BT + (r0 + o_c)[None, :], b_d)


@triton.jit
def value_dqk(
    Q,
    K_,
    V_,
    B,
    DO,
    Hs,
    DHE,
    D,
    Cu,
    ChunkSeq,
    ChunkOff,
    scale,
    DQ,
    DK_,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BC: tl.constexpr,
    PREC: tl.constexpr,
    DOT: tl.constexpr,
    EMU: tl.constexpr,
):
    """``dq``, ``dk`` of one chunk and key tile, the whole chunk at once, from :func:`value_pairs`' ``D``::

        dq = scale ((do exp(b)) @ h^T + D @ k)
        dk = (v exp(b_L - b)) @ dhe^T + scale D^T @ q

    ``D^T`` is loaded transposed. Grid ``(NT * cdiv(DK, BK), H)``."""
    NK: tl.constexpr = (DK + BK - 1) // BK
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    i_t = i_p // NK
    i_k = i_p % NK
    _, bos, n_rows = chunk_span(Cu, ChunkSeq, ChunkOff, i_t, BT)
    base = (i_t.to(tl.int64) * H + i_h) * (BT * BT)
    o_t = tl.arange(0, BT)
    rows = bos + o_t
    m_t = o_t < n_rows
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < DK
    m_tk = m_t[:, None] & m_k[None, :]
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    for i_v in range(tl.cdiv(DV, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < DV
        b_l = chunk_total(B, bos, n_rows, o_v, m_v, i_h, H, DV)
        b = gates(B, rows, o_v, m_t, m_v, b_l, i_h, H, DV, False)
        b_do = tile(DO, rows[:, None], o_v[None, :], m_t[:, None] & m_v[None, :], i_h, H, DV)
        b_hT = state_at(Hs, i_t, i_h, o_v[:, None], o_k[None, :], m_v[:, None], m_k[None, :], H, DV, DK)
        b_dq = mm(b_do * tl.exp(b), b_hT, b_dq, 1, 0, DOT, EMU, PREC)
    b_d = tl.load(D + base + o_t[:, None] * BT + o_t[None, :])
    b_k = raw(K_, rows[:, None], o_k[None, :], m_tk, i_h, H, DK, EMU)
    b_dq = mm(b_d * scale, b_k, b_dq * scale, 1, 0, DOT, EMU, PREC)
    tl.store(DQ + (rows[:, None] * H + i_h) * DK + o_k[None, :], b_dq.to(DQ.dtype.element_ty), mask=m_tk)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    for i_v in range(tl.cdiv(DV, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < DV
        b_l = chunk_total(B, bos, n_rows, o_v, m_v, i_h, H, DV)
        b = gates(B, rows, o_v, m_t, m_v, b_l, i_h, H, DV, False)
        b_v = tile(V_, rows[:, None], o_v[None, :], m_t[:, None] & m_v[None, :], i_h, H, DV)
        b_dheT = state_at(DHE, i_t, i_h, o_v[:, None], o_k[None, :], m_v[:, None], m_k[None, :], H, DV, DK)
        b_dk = mm(b_v * tl.exp(b_l[None, :] - b), b_dheT, b_dk, 1, 0, DOT, EMU, PREC)
    b_dT = tl.load(D + base + o_t[None, :] * BT + o_t[:, None])
    b_q = raw(Q, rows[:, None], o_k[None, :], m_tk, i_h, H, DK, EMU)
    b_dk = mm(b_dT * scale, b_q, b_dk, 1, 0, DOT, EMU, PREC)
    tl.store(DK_ + (rows[:, None] * H + i_h) * DK + o_k[None, :], b_dk.to(DK_.dtype.element_ty), mask=m_tk)
