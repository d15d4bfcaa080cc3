"""Triton kernels of flash attention: forward, and the FlashAttention-2 backward.

Layouts (all C-contiguous, built by ``interface.py``):

* ``q [B, T, H, D]``, ``k [B, S, KH, D]``, ``v [B, S, KH, DV]``, ``o``/``do [B, T, H, DV]``;
* ``lse``/``delta [B, H, T]`` float32;
* ``bias [NB, NH, T, S]`` (``NB`` in ``{1, B}``, ``NH`` in ``{1, H}``; a broadcast dimension has
  stride 0), ``mask`` likewise as int8 (nonzero = attend);
* segment ids ``[B, T]`` / ``[B, S]`` int32;
* ``row_lo``/``row_hi [1|B, T]`` int32: query ``i`` may attend keys ``row_lo[i] <= j < row_hi[i]``
  (the causal, sliding-window, varlen, key-length and prefix-LM constraints, computed once in JAX by
  ``ejkernel.kernels.signatures._attention.mask_intervals``; an empty row has ``lo = S, hi = 0``);
  ``col_lo``/``col_hi [1|B, S]``: key ``j`` is attended by the queries ``col_lo[j] <= i < col_hi[j]``
  (the same constraints seen from the key side; ``lo = T, hi = 0`` when empty). ``ROWS_PER_BATCH``:
  one table per batch row (per-sequence lengths), else one shared by all.

The intervals are what lets every kernel skip work: a block of rows only visits the key blocks in
``[min lo, max hi)``, and the key blocks that every row of the block admits whole (``max lo``..
``min hi``) run an unmasked loop body. Attention masks and segment ids are per element, so with
them every visited tile takes the masked path.

Scores are kept in log2 units (``s * log2(e)``) so that the softmax uses ``exp2``; ``lse`` is
stored in natural-log units, ``-inf`` for a row that admits no key.

Names follow the fla convention: ``b_x`` a tile in registers, ``p_x`` a tile of pointers, ``m_i``
the running row max, ``l_i`` the running row sum; ``# [BM, BD]`` comments give tile shapes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ejkernel_triton.language import (  # imports ejkernel_triton.launch first: the interpreter switch
    LN2,
    LOG2E,
    bcast_base,
    block_range,
    bounds,
    dropout_head_hash,
    dropout_keep,
    dropout_keep_mask,
    dropout_row_hash,
    head_base,
    load_tile,
    mix32,
    mma,
    online_softmax_step,
    span,
    stats_base,
    store_tile,
    tanh,
)

# ------------------------------------------------------------------------------------------------
# Attention-specific helpers (inlined by Triton); the generic ones are in ejkernel_triton.language.
# ------------------------------------------------------------------------------------------------


@triton.jit
def _allowed(ii, jj, lo, hi, mask_base, qseg, kseg, S, HAS_MASK: tl.constexpr, HAS_SEG: tl.constexpr):
    """Which (query ``ii``, key ``jj``) pairs attend; every argument broadcasts to the tile shape.

    The interval test also rejects rows past T and keys past S (their intervals are empty / never
    reach past S), so the mask load below is always in bounds."""
    ok = (jj >= lo) & (jj < hi)
    if HAS_MASK:
        b_m = tl.load(mask_base + ii.to(tl.int64) * S + jj, mask=ok, other=0)
        ok = ok & (b_m != 0)
    if HAS_SEG:
        ok = ok & (qseg == kseg)
    return ok


@triton.jit
def _scores(
    qk,
    ii,
    jj,
    ok,
    bias_base,
    sm_scale,
    softcap,
    S,
    CHECK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """Raw ``q . k`` -> scores in log2 units, in the contract's order: scale, + bias, soft cap.

    Also returns ``tanh(s / softcap)`` (needed by the soft-cap backward; a dummy without it).
    ``ok`` guards the bias load where the tile may leave the matrix (``CHECK``)."""
    if HAS_BIAS or HAS_SOFTCAP:
        s = qk * sm_scale
        if HAS_BIAS:
            p_bias = bias_base + ii.to(tl.int64) * S + jj
            if CHECK:
                b_bias = tl.load(p_bias, mask=ok, other=0.0)
            else:
                b_bias = tl.load(p_bias)
            s = s + b_bias.to(tl.float32)
        t = s
        if HAS_SOFTCAP:
            t = tanh(s / softcap)
            s = softcap * t
        s2 = s * LOG2E
    else:
        s2 = qk * (sm_scale * LOG2E)
        t = s2
    return s2, t


@triton.jit
def _row_bounds(RowLo, RowHi, QSeg, rows, T, S, HAS_SEG: tl.constexpr):
    """Key interval and segment id of each query row (rows past T: ``lo = S, hi = 0``)."""
    lo, hi = bounds(RowLo, RowHi, rows, T, S)
    return lo, hi, _seg_ids(QSeg, rows, T, -1, HAS_SEG)


@triton.jit
def _table(Table, i_b64, n, PER_BATCH: tl.constexpr):
    """Batch row ``i_b64``'s interval table (``[B, n]`` tables), or the one all rows share (``[1, n]``)."""
    if PER_BATCH:
        return Table + i_b64 * n
    else:
        return Table


@triton.jit
def _query_program(H: tl.constexpr, KH: tl.constexpr):
    """Who a program of the query-block kernels (forward, dQ; grid ``(cdiv(T, BM), H, B)``) is:
    its query block, head, kv head (GQA/MQA: query head h reads kv head h // (H // KH)), batch."""
    pid_m = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2)
    i_kh = i_h // (H // KH)
    return pid_m, i_h, i_b, i_kh, i_b.to(tl.int64)


@triton.jit
def _seg_ids(Seg, idx, n, PAD: tl.constexpr, LOAD: tl.constexpr):
    """Segment ids at ``idx`` when ``LOAD`` (``PAD`` past ``n``: -1 for queries, -2 for keys, so
    that padding never matches); ``idx`` itself, unused, otherwise."""
    if LOAD:
        seg = tl.load(Seg + idx, mask=idx < n, other=PAD)
    else:
        seg = idx
    return seg


@triton.jit
def _tile_scores(
    qk,
    ii,
    jj,
    lo,
    hi,
    qseg,
    kseg,
    mask_base,
    bias_base,
    sm_scale,
    softcap,
    S,
    MASKED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_SEG: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """Scores of one tile in log2 units, ``-inf`` where the pair does not attend, and the soft
    cap's ``tanh`` (see :func:`_scores`). The loop body every kernel shares.

    The index arguments come broadcast to the tile's orientation: ``ii``/``lo``/``hi``/``qseg``
    along the query axis, ``jj``/``kseg`` along the key axis (``[BM, BN]`` tiles in the forward and
    dQ kernels, ``[BN, BM]`` in the dK/dV kernel). ``MASKED``: the tile may hold rejected pairs or
    leave the matrix; otherwise every pair attends and no mask is built."""
    if MASKED:
        ok = _allowed(ii, jj, lo, hi, mask_base, qseg, kseg, S, HAS_MASK, HAS_SEG)
        s2, t = _scores(qk, ii, jj, ok, bias_base, sm_scale, softcap, S, True, HAS_BIAS, HAS_SOFTCAP)
        s2 = tl.where(ok, s2, float("-inf"))
    else:
        s2, t = _scores(qk, ii, jj, 0, bias_base, sm_scale, softcap, S, False, HAS_BIAS, HAS_SOFTCAP)
    return s2, t


@triton.jit
def _dscores(b_p, b_dp, b_delta, b_t, keep, drop_scale, HAS_SOFTCAP: tl.constexpr, DROP_THRESH: tl.constexpr):
    """dS = P * (dP - delta), with dP = dO V^T through the dropout mask and its 1/(1-p) scale,
    times 1 - tanh^2 under a soft cap. ``b_delta`` comes broadcast to the tile."""
    if DROP_THRESH > 0:
        b_dp = tl.where(keep, b_dp * drop_scale, 0.0)
    b_ds = b_p * (b_dp - b_delta)
    if HAS_SOFTCAP:
        b_ds = b_ds * (1.0 - b_t * b_t)
    return b_ds


# ------------------------------------------------------------------------------------------------
# Forward. Its loop over key blocks (_query_block_inner) also serves the dQ kernel.
# ------------------------------------------------------------------------------------------------


@triton.jit
def _query_block_inner(
    acc,
    l_i,
    m_i,
    b_q,
    b_do,
    lse2,
    b_delta,
    offs_m,
    lo,
    hi,
    qseg,
    row_hash,
    k_base,
    v_base,
    bias_base,
    mask_base,
    kseg_base,
    sm_scale,
    softcap,
    drop_scale,
    S,
    n_start,
    n_stop,
    KH: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DQ: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_SEG: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DROP_THRESH: tl.constexpr,
):
    """One block of query rows against the key blocks ``[n_start, n_stop)``: the loop of the
    forward (``DQ`` False) and of the dQ kernel (``DQ`` True), which see the same tiles and scores.

    Forward: online softmax; ``acc``/``l_i``/``m_i`` are the running output, row sum and row max,
    and ``b_do``/``lse2``/``b_delta`` go unused. dQ: P is recomputed from the saved ``lse2`` and
    ``acc`` accumulates dS K ``[BM, BD]``; ``l_i``/``m_i`` come back as they went in."""
    ii = offs_m[:, None]  # [BM, 1]
    for start_n in range(n_start, n_stop, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        jj = offs_n[None, :]  # [1, BN]
        # S_ij = q_i . k_j on the tensor cores. dQ loads V (for dP) together with K, the forward
        # only after the softmax: the load order is part of each kernel's measured schedule.
        b_k = load_tile(k_base, offs_n, KH * D, S, D, BLOCK_D, MASKED)  # [BN, BD]
        if DQ:
            b_v = load_tile(v_base, offs_n, KH * DV, S, DV, BLOCK_DV, MASKED)  # [BN, BDV]
        b_qk = mma(b_q, tl.trans(b_k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32))  # [BM, BN]
        b_kseg = _seg_ids(kseg_base, offs_n, S, -2, MASKED and HAS_SEG)
        b_s, b_t = _tile_scores(
            b_qk,
            ii,
            jj,
            lo[:, None],
            hi[:, None],
            qseg[:, None],
            b_kseg[None, :],
            mask_base,
            bias_base,
            sm_scale,
            softcap,
            S,
            MASKED,
            HAS_BIAS,
            HAS_MASK,
            HAS_SEG,
            HAS_SOFTCAP,
        )  # [BM, BN]
        if DQ:
            b_p = tl.exp2(b_s - lse2[:, None])  # [BM, BN]
            b_dp = mma(b_do, tl.trans(b_v), tl.zeros([BLOCK_M, BLOCK_N], tl.float32))  # [BM, BN]
            keep = dropout_keep_mask(row_hash[:, None], jj, DROP_THRESH)
            b_ds = _dscores(b_p, b_dp, b_delta[:, None], b_t, keep, drop_scale, HAS_SOFTCAP, DROP_THRESH)
            acc = mma(b_ds.to(b_k.dtype), b_k, acc)  # [BM, BD]
        else:
            # Online softmax (rows that have seen only -inf, from the masks or the bias, stay NaN-free)
            b_p, m_i, l_i, acc = online_softmax_step(b_s, m_i, l_i, acc)  # [BM, BN], [BM], [BM], [BM, BDV]
            # Dropout acts on the normalized probabilities, so l_i (the softmax denominator) is
            # summed before it; the 1/(1-p) survivor scale is applied once at the end.
            if DROP_THRESH > 0:
                b_p = tl.where(dropout_keep(row_hash[:, None], jj, DROP_THRESH), b_p, 0.0)
            b_v = load_tile(v_base, offs_n, KH * DV, S, DV, BLOCK_DV, MASKED)  # [BN, BDV]
            acc = mma(b_p.to(b_v.dtype), b_v, acc)  # [BM, BDV]
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(
    Q,
    K,
    V,
    Bias,
    Mask,
    QSeg,
    KSeg,
    RowLo,
    RowHi,
    Seed,
    sm_scale,
    softcap,
    drop_scale,
    T,
    S,
    bias_sb,
    bias_sh,
    mask_sb,
    mask_sh,
    O,
    LSE,
    H: tl.constexpr,
    KH: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_SEG: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DROP_THRESH: tl.constexpr,
    ROWS_PER_BATCH: tl.constexpr,
):
    """One program: BLOCK_M query rows of one (batch, head). Grid ``(cdiv(T, BM), H, B)``."""
    pid_m, i_h, i_b, i_kh, i_b64 = _query_program(H, KH)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    lo, hi, qseg = _row_bounds(
        _table(RowLo, i_b64, T, ROWS_PER_BATCH),
        _table(RowHi, i_b64, T, ROWS_PER_BATCH),
        QSeg + i_b64 * T,
        offs_m,
        T,
        S,
        HAS_SEG,
    )  # [BM]
    n_start, n_full_lo, n_full_hi, n_end = block_range(lo, hi, BLOCK_N, HAS_MASK or HAS_SEG)

    q_base = head_base(Q, i_b64, i_h, T, H, D)
    k_base = head_base(K, i_b64, i_kh, S, KH, D)
    v_base = head_base(V, i_b64, i_kh, S, KH, DV)
    bias_base = bcast_base(Bias, i_b64, i_h, bias_sb, bias_sh)
    mask_base = bcast_base(Mask, i_b64, i_h, mask_sb, mask_sh)
    row_hash = dropout_row_hash(Seed, i_b, i_h, offs_m, H, DROP_THRESH)  # [BM]

    b_q = load_tile(q_base, offs_m, H * D, T, D, BLOCK_D, True)  # [BM, BD]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    # Key blocks partly admitted (band edges, ragged ends), then the interior, then the far edge.
    for PART in tl.static_range(3):
        n_lo, n_hi = span(PART, n_start, n_full_lo, n_full_hi, n_end)
        acc, l_i, m_i = _query_block_inner(
            acc,
            l_i,
            m_i,
            b_q,
            b_q,  # unused: b_do, lse2, b_delta
            l_i,
            l_i,
            offs_m,
            lo,
            hi,
            qseg,
            row_hash,
            k_base,
            v_base,
            bias_base,
            mask_base,
            KSeg + i_b64 * S,
            sm_scale,
            softcap,
            drop_scale,
            S,
            n_lo,
            n_hi,
            KH,
            D,
            DV,
            BLOCK_D,
            BLOCK_DV,
            BLOCK_M,
            BLOCK_N,
            False,
            PART != 1,
            HAS_BIAS,
            HAS_MASK,
            HAS_SEG,
            HAS_SOFTCAP,
            DROP_THRESH,
        )

    # Normalize; a row that admitted no key has l_i == 0: output 0, lse -inf (never NaN).
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    acc = acc * (drop_scale / l_safe)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)  # natural log
    store_tile(head_base(O, i_b64, i_h, T, H, DV), acc, offs_m, H * DV, T, DV, BLOCK_DV)
    tl.store(stats_base(LSE, i_b64, i_h, T, H) + offs_m, lse, mask=offs_m < T)


# ------------------------------------------------------------------------------------------------
# Backward (FlashAttention-2): delta = rowsum(dO * O); dK, dV per key block; dQ per query block.
#
# With P = softmax(S), Z the dropout keep mask and r = 1/(1-p):  O = (P * Z * r) V, so
#   dV = (P * Z * r)^T dO,   dP = (dO V^T) * Z * r,   dS = P * (dP - delta),
#   delta_i = sum_j P_ij dP_ij = sum_d dO_id O_id   (dropout included),
# then the soft cap multiplies dS by 1 - tanh^2, dBias = dS, dQ = scale dS K, dK = scale dS^T Q.
# P is recomputed from the saved lse: P = exp2(s2 - lse * log2(e)).
#
# Tiles (FA2): the dK/dV kernel holds BLOCK_N keys and streams BLOCK_M queries; the dQ kernel holds
# BLOCK_M queries and streams BLOCK_N keys. Each kernel does best with a long held tile and a short
# streamed one, so interface.py launches them with transposed block pairs.
# ------------------------------------------------------------------------------------------------


@triton.jit
def _attn_bwd_delta(O, DO, T, Delta, H: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta[b, h, i] = sum_d dO[b, i, h, d] * O[b, i, h, d] in float32. Grid ``(cdiv(T, BM), H, B)``."""
    pid_m = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b64 = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    base = i_b64 * T * (H * DV) + i_h * DV  # O and dO share their layout
    b_o = load_tile(O + base, offs_m, H * DV, T, DV, BLOCK_DV, True).to(tl.float32)  # [BM, BDV]
    b_do = load_tile(DO + base, offs_m, H * DV, T, DV, BLOCK_DV, True).to(tl.float32)
    tl.store(stats_base(Delta, i_b64, i_h, T, H) + offs_m, tl.sum(b_o * b_do, 1), mask=offs_m < T)


@triton.jit
def _load_lse2(LSE, rows, T):
    """Saved lse in log2 units; -inf (row admits nothing) becomes +inf so that P = exp2(s2 - lse2)
    is 0 there instead of NaN."""
    lse = tl.load(LSE + rows, mask=rows < T, other=0.0)
    return tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)


@triton.jit
def _dkdv_inner(
    b_dk,
    b_dv,
    b_k,
    b_v,
    offs_n,
    kseg,
    q_base,
    do_base,
    LSE_bh,
    Delta_bh,
    RowLo,
    RowHi,
    bias_base,
    mask_base,
    qseg_base,
    row_hash_seed,
    sm_scale,
    softcap,
    drop_scale,
    T,
    S,
    m_start,
    m_stop,
    H: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_SEG: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DROP_THRESH: tl.constexpr,
):
    """Accumulate dK, dV of one key block over the query blocks ``[m_start, m_stop)`` of one head.

    Tiles are kept transposed (keys along dim 0, ``[BN, BM]``) so that the key block stays the
    row dimension of every dot: dV += P^T dO and dK += dS^T Q need no register transposes."""
    jj = offs_n[:, None]  # [BN, 1]
    for start_m in range(m_start, m_stop, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        ii = offs_m[None, :]  # [1, BM]
        b_q = load_tile(q_base, offs_m, H * D, T, D, BLOCK_D, MASKED)  # [BM, BD]
        b_do = load_tile(do_base, offs_m, H * DV, T, DV, BLOCK_DV, MASKED)  # [BM, BDV]
        lse2 = _load_lse2(LSE_bh, offs_m, T)  # [BM]
        b_delta = tl.load(Delta_bh + offs_m, mask=offs_m < T, other=0.0)  # [BM]
        b_qkT = mma(b_k, tl.trans(b_q), tl.zeros([BLOCK_N, BLOCK_M], tl.float32))  # [BN, BM]
        if MASKED:
            lo, hi, qseg = _row_bounds(RowLo, RowHi, qseg_base, offs_m, T, S, HAS_SEG)
        else:
            lo, hi, qseg = offs_m, offs_m, offs_m  # unused: every pair of the tile attends
        b_sT, b_tT = _tile_scores(
            b_qkT,
            ii,
            jj,
            lo[None, :],
            hi[None, :],
            qseg[None, :],
            kseg[:, None],
            mask_base,
            bias_base,
            sm_scale,
            softcap,
            S,
            MASKED,
            HAS_BIAS,
            HAS_MASK,
            HAS_SEG,
            HAS_SOFTCAP,
        )  # [BN, BM]
        b_pT = tl.exp2(b_sT - lse2[None, :])  # [BN, BM]
        b_dpT = mma(b_v, tl.trans(b_do), tl.zeros([BLOCK_N, BLOCK_M], tl.float32))  # [BN, BM] = (dO V^T)^T
        if DROP_THRESH > 0:
            keep = dropout_keep_mask(mix32(row_hash_seed ^ offs_m.to(tl.uint32))[None, :], jj, DROP_THRESH)
            b_pdT = tl.where(keep, b_pT * drop_scale, 0.0)
        else:
            keep = jj
            b_pdT = b_pT
        b_dv = mma(b_pdT.to(b_do.dtype), b_do, b_dv)  # [BN, BDV]
        b_dsT = _dscores(b_pT, b_dpT, b_delta[None, :], b_tT, keep, drop_scale, HAS_SOFTCAP, DROP_THRESH)
        b_dk = mma(b_dsT.to(b_q.dtype), b_q, b_dk)  # [BN, BD]
    return b_dk, b_dv


@triton.jit
def _attn_bwd_dkdv(
    Q,
    K,
    V,
    Bias,
    Mask,
    QSeg,
    KSeg,
    RowLo,
    RowHi,
    ColLo,
    ColHi,
    Seed,
    DO,
    LSE,
    Delta,
    sm_scale,
    softcap,
    drop_scale,
    T,
    S,
    bias_sb,
    bias_sh,
    mask_sb,
    mask_sh,
    DKey,
    DVal,
    H: tl.constexpr,
    KH: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_SEG: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DROP_THRESH: tl.constexpr,
    ROWS_PER_BATCH: tl.constexpr,
):
    """One program: BLOCK_N keys of one (batch, kv head); loops over the H // KH query heads that
    share it (GQA) and over their query blocks, so dK/dV are summed in registers and written
    once (deterministic, no atomics). Grid ``(cdiv(S, BN), KH, B)``."""
    GROUP = H // KH
    pid_n = tl.program_id(0)
    i_kh = tl.program_id(1)
    i_b = tl.program_id(2)
    i_b64 = i_b.to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    # Query interval of every key: which query blocks to visit, and which need no mask.
    qlo, qhi = bounds(_table(ColLo, i_b64, S, ROWS_PER_BATCH), _table(ColHi, i_b64, S, ROWS_PER_BATCH), offs_n, S, T)
    m_start, m_full_lo, m_full_hi, m_end = block_range(qlo, qhi, BLOCK_M, HAS_MASK or HAS_SEG)

    k_base = head_base(K, i_b64, i_kh, S, KH, D)
    v_base = head_base(V, i_b64, i_kh, S, KH, DV)
    b_k = load_tile(k_base, offs_n, KH * D, S, D, BLOCK_D, True)  # [BN, BD]
    b_v = load_tile(v_base, offs_n, KH * DV, S, DV, BLOCK_DV, True)  # [BN, BDV]
    kseg = _seg_ids(KSeg + i_b64 * S, offs_n, S, -2, HAS_SEG)
    b_dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    b_dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)

    for g in range(GROUP):
        i_h = i_kh * GROUP + g
        if DROP_THRESH > 0:
            row_hash_seed = dropout_head_hash(Seed, i_b, i_h, H)  # the (b, h) half of row_hash, hoisted
        else:
            row_hash_seed = 0
        for PART in tl.static_range(3):
            m_lo, m_hi = span(PART, m_start, m_full_lo, m_full_hi, m_end)
            b_dk, b_dv = _dkdv_inner(
                b_dk,
                b_dv,
                b_k,
                b_v,
                offs_n,
                kseg,
                head_base(Q, i_b64, i_h, T, H, D),
                head_base(DO, i_b64, i_h, T, H, DV),
                stats_base(LSE, i_b64, i_h, T, H),
                stats_base(Delta, i_b64, i_h, T, H),
                _table(RowLo, i_b64, T, ROWS_PER_BATCH),
                _table(RowHi, i_b64, T, ROWS_PER_BATCH),
                bcast_base(Bias, i_b64, i_h, bias_sb, bias_sh),
                bcast_base(Mask, i_b64, i_h, mask_sb, mask_sh),
                QSeg + i_b64 * T,
                row_hash_seed,
                sm_scale,
                softcap,
                drop_scale,
                T,
                S,
                m_lo,
                m_hi,
                H,
                D,
                DV,
                BLOCK_D,
                BLOCK_DV,
                BLOCK_M,
                BLOCK_N,
                PART != 1,
                HAS_BIAS,
                HAS_MASK,
                HAS_SEG,
                HAS_SOFTCAP,
                DROP_THRESH,
            )

    store_tile(head_base(DKey, i_b64, i_kh, S, KH, D), b_dk * sm_scale, offs_n, KH * D, S, D, BLOCK_D)
    store_tile(head_base(DVal, i_b64, i_kh, S, KH, DV), b_dv, offs_n, KH * DV, S, DV, BLOCK_DV)


@triton.jit
def _attn_bwd_dq(
    Q,
    K,
    V,
    Bias,
    Mask,
    QSeg,
    KSeg,
    RowLo,
    RowHi,
    Seed,
    DO,
    LSE,
    Delta,
    sm_scale,
    softcap,
    drop_scale,
    T,
    S,
    bias_sb,
    bias_sh,
    mask_sb,
    mask_sh,
    DQ,
    H: tl.constexpr,
    KH: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_SEG: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DROP_THRESH: tl.constexpr,
    ROWS_PER_BATCH: tl.constexpr,
):
    """One program: dQ of BLOCK_M query rows of one (batch, head), over the same key blocks as the
    forward (a separate kernel rather than atomics: deterministic). Grid ``(cdiv(T, BM), H, B)``."""
    pid_m, i_h, i_b, i_kh, i_b64 = _query_program(H, KH)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    lo, hi, qseg = _row_bounds(
        _table(RowLo, i_b64, T, ROWS_PER_BATCH),
        _table(RowHi, i_b64, T, ROWS_PER_BATCH),
        QSeg + i_b64 * T,
        offs_m,
        T,
        S,
        HAS_SEG,
    )
    n_start, n_full_lo, n_full_hi, n_end = block_range(lo, hi, BLOCK_N, HAS_MASK or HAS_SEG)

    k_base = head_base(K, i_b64, i_kh, S, KH, D)
    v_base = head_base(V, i_b64, i_kh, S, KH, DV)
    bias_base = bcast_base(Bias, i_b64, i_h, bias_sb, bias_sh)
    mask_base = bcast_base(Mask, i_b64, i_h, mask_sb, mask_sh)
    row_hash = dropout_row_hash(Seed, i_b, i_h, offs_m, H, DROP_THRESH)

    b_q = load_tile(head_base(Q, i_b64, i_h, T, H, D), offs_m, H * D, T, D, BLOCK_D, True)  # [BM, BD]
    b_do = load_tile(head_base(DO, i_b64, i_h, T, H, DV), offs_m, H * DV, T, DV, BLOCK_DV, True)  # [BM, BDV]
    lse2 = _load_lse2(stats_base(LSE, i_b64, i_h, T, H), offs_m, T)
    b_delta = tl.load(stats_base(Delta, i_b64, i_h, T, H) + offs_m, mask=offs_m < T, other=0.0)
    b_dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for PART in tl.static_range(3):
        n_lo, n_hi = span(PART, n_start, n_full_lo, n_full_hi, n_end)
        b_dq, _l, _m = _query_block_inner(
            b_dq,
            lse2,  # unused: l_i, m_i
            lse2,
            b_q,
            b_do,
            lse2,
            b_delta,
            offs_m,
            lo,
            hi,
            qseg,
            row_hash,
            k_base,
            v_base,
            bias_base,
            mask_base,
            KSeg + i_b64 * S,
            sm_scale,
            softcap,
            drop_scale,
            S,
            n_lo,
            n_hi,
            KH,
            D,
            DV,
            BLOCK_D,
            BLOCK_DV,
            BLOCK_M,
            BLOCK_N,
            True,
            PART != 1,
            HAS_BIAS,
            HAS_MASK,
            HAS_SEG,
            HAS_SOFTCAP,
            DROP_THRESH,
        )
    store_tile(head_base(DQ, i_b64, i_h, T, H, D), b_dq * sm_scale, offs_m, H * D, T, D, BLOCK_D)


@triton.jit
def _attn_bwd_dbias(
    Q,
    K,
    V,
    Bias,
    Mask,
    QSeg,
    KSeg,
    RowLo,
    RowHi,
    Seed,
    DO,
    LSE,
    Delta,
    sm_scale,
    softcap,
    drop_scale,
    B,
    T,
    S,
    bias_sb,
    bias_sh,
    mask_sb,
    mask_sh,
    DBias,
    H: tl.constexpr,
    KH: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    NBH: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BIAS_BCAST_B: tl.constexpr,
    BIAS_BCAST_H: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_SEG: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DROP_THRESH: tl.constexpr,
    ROWS_PER_BATCH: tl.constexpr,
):
    """dBias = dS, summed over the dimensions the bias broadcasts over, written once per element
    (the output has the bias's own shape ``[NB, NH, T, S]``: no ``[B, H, T, S]`` intermediate, no
    atomics). A separate kernel so that XLA drops it when the bias needs no gradient.
    Grid ``(cdiv(T, BM) * cdiv(S, BN), NBH, NB)``; recomputes P and dP per (batch, head) summed."""
    n_blocks_n = (S + BLOCK_N - 1) // BLOCK_N
    pid_m = tl.program_id(0) // n_blocks_n
    pid_n = tl.program_id(0) % n_blocks_n
    h_first = tl.program_id(1)
    b_first = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    ii = offs_m[:, None]
    jj = offs_n[None, :]
    b_first64 = b_first.to(tl.int64)
    lo, hi = bounds(
        _table(RowLo, b_first64, T, ROWS_PER_BATCH), _table(RowHi, b_first64, T, ROWS_PER_BATCH), offs_m, T, S
    )
    # Does any row of the block admit any key of the block? Otherwise dBias is 0 here. (With a table per
    # batch row and a bias broadcast over the batch, another row may: then every tile is visited.)
    live = (tl.max(hi, axis=0) > pid_n * BLOCK_N) & (tl.min(lo, axis=0) < pid_n * BLOCK_N + BLOCK_N)
    if ROWS_PER_BATCH and BIAS_BCAST_B:
        live = live | True

    if BIAS_BCAST_B:
        b_count = B
    else:
        b_count = 1
    if BIAS_BCAST_H:
        h_count = H
    else:
        h_count = 1
    b_count = tl.where(live, b_count, 0)
    bias_base = bcast_base(Bias, b_first.to(tl.int64), h_first, bias_sb, bias_sh)
    b_acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # [BM, BN]
    for bb in range(b_count):
        i_b = b_first + bb
        i_b64 = i_b.to(tl.int64)
        if ROWS_PER_BATCH and BIAS_BCAST_B:
            lo, hi = bounds(_table(RowLo, i_b64, T, True), _table(RowHi, i_b64, T, True), offs_m, T, S)
        qseg = _seg_ids(QSeg + i_b64 * T, offs_m, T, -1, HAS_SEG)
        kseg = _seg_ids(KSeg + i_b64 * S, offs_n, S, -2, HAS_SEG)
        for hh in range(h_count):
            i_h = h_first + hh
            i_kh = i_h // (H // KH)
            b_q = load_tile(head_base(Q, i_b64, i_h, T, H, D), offs_m, H * D, T, D, BLOCK_D, True)
            b_do = load_tile(head_base(DO, i_b64, i_h, T, H, DV), offs_m, H * DV, T, DV, BLOCK_DV, True)
            b_k = load_tile(head_base(K, i_b64, i_kh, S, KH, D), offs_n, KH * D, S, D, BLOCK_D, True)
            b_v = load_tile(head_base(V, i_b64, i_kh, S, KH, DV), offs_n, KH * DV, S, DV, BLOCK_DV, True)
            lse2 = _load_lse2(stats_base(LSE, i_b64, i_h, T, H), offs_m, T)
            b_delta = tl.load(stats_base(Delta, i_b64, i_h, T, H) + offs_m, mask=offs_m < T, other=0.0)
            b_qk = mma(b_q, tl.trans(b_k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32))
            b_s, b_t = _tile_scores(
                b_qk,
                ii,
                jj,
                lo[:, None],
                hi[:, None],
                qseg[:, None],
                kseg[None, :],
                bcast_base(Mask, i_b64, i_h, mask_sb, mask_sh),
                bias_base,
                sm_scale,
                softcap,
                S,
                True,
                True,
                HAS_MASK,
                HAS_SEG,
                HAS_SOFTCAP,
            )
            b_p = tl.exp2(b_s - lse2[:, None])
            b_dp = mma(b_do, tl.trans(b_v), tl.zeros([BLOCK_M, BLOCK_N], tl.float32))
            row_hash = dropout_row_hash(Seed, i_b, i_h, offs_m, H, DROP_THRESH)
            keep = dropout_keep_mask(row_hash[:, None], jj, DROP_THRESH)
            b_acc += _dscores(b_p, b_dp, b_delta[:, None], b_t, keep, drop_scale, HAS_SOFTCAP, DROP_THRESH)
    p_db = DBias + (b_first.to(tl.int64) * NBH + h_first) * T * S + ii.to(tl.int64) * S + jj
    tl.store(p_db, b_acc.to(DBias.dtype.element_ty), mask=(ii < T) & (jj < S))
