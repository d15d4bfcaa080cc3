"""The chunked kernels of gated linear attention (``gla``), forward and backward.

Per sequence and value head the recurrence ``S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t``, ``o_t = scale q_t S_t``
is cut into chunks of ``BT`` tokens. Inside a chunk, with ``b`` the cumulative log gate from the chunk's start
(token included) and ``b_L`` its last valid row, a chunk entered with state ``S`` gives::

    o_i    = scale (q_i * exp(b_i)) S  +  sum_{j <= i} A_ij v_j,   A_ij = scale sum_c q_ic k_jc exp(b_ic - b_jc)
    S_next = diag(exp(b_L)) S  +  (k * exp(b_L - b))^T v

Kernels (``launch`` order; the forward is the first four, the backward recomputes the states (the gates and ``A``
too when it cuts other chunks than the forward) and runs the rest):

* :func:`chunk_gate_cumsum`: ``b``, the chunk-local cumulative gates (float32);
* :func:`chunk_state_fwd`: one program per (sequence, value head, key block, value block) walks the chunks and
  stores the state at each chunk's start ``h [NT, HV, K, V]`` (in ``h``'s dtype: the forward's feeds only dots
  that round it to bfloat16 for bfloat16 inputs, so it is stored so) and the final state;
* :func:`chunk_intra_diag`, :func:`chunk_intra_offdiag`: ``A [NT, HV, BT, BT]`` (scale included; zeros above the
  diagonal; in ``A``'s dtype, bfloat16 for bfloat16 inputs: every dot that reads it rounds it so), one program per
  ``[BC, BC]`` block: the diagonal blocks (and the zeros right of them) first, then those below into the same array;
  the first also writes the decayed keys ``k exp(b_L - b)`` when the forward's walk reads them (``Plan.decayed_keys``:
  then these run before :func:`chunk_state_fwd`; not yet the default: being checked on the H200);
* :func:`chunk_output`: ``o = scale (q * exp(b)) @ h + A @ v``;
* :func:`chunk_state_bwd`: the reverse recurrence of the state's gradient; stores ``dhe``, the gradient of the
  state at each chunk's *end* (what the chunk's keys and values fed), and the initial state's gradient;
* :func:`chunk_state_pair`: the backward's recompute of the states and :func:`chunk_state_bwd` in one launch (they
  are independent), when the plan pairs them (``Plan.paired_states``; not yet the default: being checked on the H200);
* :func:`chunk_attn_grad`: ``dA = scale do @ v^T`` below the diagonal;
* :func:`chunk_dv`: ``dv = A^T @ do + (k * exp(b_L - b)) @ dhe``;
* :func:`chunk_dqk_intra` (one program per ``BC`` rows and key tile), :func:`chunk_dqk_inter`: ``dq``, ``dk`` (per
  value head) and the gates' gradient ``dg``, chunk by chunk (:func:`chunk_dqk_inter` says how: no reverse
  cumulative sum over the whole sequence).

``HAS_GV`` (:func:`chunk_state_fwd`, :func:`chunk_state_bwd`, :func:`chunk_dqk_inter`; off for ``gla``, where the
branch compiles away): the state's columns decay too, by a second cumulative gate ``GV`` (``recurrent`` with a key
and a value gate, ``ejkernel_triton._value_chunk``, whose kernels the rest of that path is).

Numerical stability (log gates may be -100 per token): no exponent is ever positive. The intra-chunk pairs
``i > j`` are taken by blocks of ``BC = 16`` rows: a pair of two blocks splits ``exp(b_i - b_j) = exp(b_i - b_r)
exp(b_r - b_j)`` at the first row ``r`` of the later block, both factors at most 1, so a pair of blocks is one
product; the pairs inside a block are taken, in the forward, one pair and channel at a time (one exponent each,
:func:`chunk_intra_diag`), in the backward level by level (:func:`level`: at level ``S`` the rows form groups
of ``2 S``, split at each group's ``S``-th row the same way), one product per level, ``log2(BC)`` of them, each
result kept on its groups (the pairs ``i == j`` need no exponent). Padded rows and channels read as 0 and are kept
out of every exponent that could be positive (a reference row is always a valid row).

Layouts (C-contiguous; ``R = B T`` rows of tokens, ``N`` sequences, ``NT`` chunks over all sequences):

* ``q``, ``k [R, H, DK]``; ``v``, ``do [R, HV, DV]``; gates ``g``, ``b [R, HV, GK]`` with ``GK == DK`` (one
  decay per key channel; the gates' loads also take ``GK == 1``, one per head broadcast over the key channels,
  but ``dg`` is per key channel);
* ``Cu [N + 1]`` int32: sequence ``n`` is rows ``[Cu[n], Cu[n + 1])`` (non-decreasing, within ``[0, R]``);
  ``ChunkOff [N + 1]``: its chunks are ``[ChunkOff[n], ChunkOff[n + 1])``; ``ChunkSeq [NT]``: the sequence of
  each chunk (a chunk past the last is empty: every row masked);
* states ``h0``, ``ht``, ``dht``, ``dh0 [N, HV, DK, DV]``, ``h``, ``dhe [NT, HV, DK, DV]``, float32 (``h`` of a
  bfloat16 forward: bfloat16).

Value head ``hv`` reads query/key head ``hv // (HV // H)`` in place. Programs that share a chunk's reads (its
row, key or value blocks) are neighbours in the grid's first axis, so the second read comes from L2.

Dots (:func:`mm`): operands in ``DOT`` (``"bf16"`` for bfloat16 inputs, else ``"fp32"`` at ``PREC``:
``"tf32x3"`` on GPUs, three tensor-core passes), float32 accumulation; gate factors, cumulative gates and states
stay float32. Products whose results must keep float32 accuracy (the final state, the initial state's and the
gates' gradients are compared at float32 tolerance for bfloat16 inputs too) split their float32 operand in a
bfloat16 high part and the bfloat16 rest (``SA``/``SB``: one more product each, two for two split operands):
the state passes (``k exp(b_L - b)`` times ``v``, unless the forward returns no final state; ``q exp(b)`` times
``do``) and ``dq``/``dk`` (which ``dg`` is made of); so do ``A``'s products (their gate factors are not exact in
bfloat16, unlike ``q`` and ``k``); ``o``, ``dA`` and ``dv`` take one product. In the interpreter (``EMU``), whose
dots of 16-bit operands are wrong, bfloat16 operands are float32 holding the rounded values. Dot results are never
transposed (``tl.trans`` of a dot accumulator is miscompiled by Triton 3.6 on Hopper): transposed operands are
loaded transposed from memory.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ejkernel_triton import launch as _launch  # noqa: F401  (the interpreter switch, before any @triton.jit)

# ------------------------------------------------------------------------------------------------
# Helpers.
# ------------------------------------------------------------------------------------------------


@triton.jit
def chunk_span(Cu, ChunkSeq, ChunkOff, i_t, BT: tl.constexpr):
    """``(sequence, first row (int64), valid rows)`` of chunk ``i_t``; a chunk past its sequence has no rows."""
    i_n = tl.load(ChunkSeq + i_t)
    bos = tl.load(Cu + i_n) + (i_t - tl.load(ChunkOff + i_n)) * BT
    n_rows = tl.minimum(tl.maximum(tl.load(Cu + i_n + 1) - bos, 0), BT)
    return i_n, bos.to(tl.int64), n_rows


@triton.jit
def tile(X, rows, cols, mask, i_head, NH: tl.constexpr, D: tl.constexpr):
    """``X[rows, i_head, cols]`` of a ``[R, NH, D]`` array as float32, masked elements 0. ``rows``/``cols``
    broadcast: ``rows[:, None], cols[None, :]`` for a tile, ``rows[None, :], cols[:, None]`` for its transpose."""
    return tl.load(X + (rows * NH + i_head) * D + cols, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def raw(X, rows, cols, mask, i_head, NH: tl.constexpr, D: tl.constexpr, EMU: tl.constexpr):
    """Like :func:`tile` in the array's own dtype (a dot operand as it is): float32 holding its values when
    ``EMU``."""
    x = tl.load(X + (rows * NH + i_head) * D + cols, mask=mask, other=0.0)
    if EMU:
        x = x.to(tl.float32)
    return x


@triton.jit
def rnd(x, DOT: tl.constexpr, EMU: tl.constexpr):
    """``x`` rounded to the dots' operand dtype ``DOT`` (``"bf16"``, ``"fp16"``; ``"fp32"``: unchanged); when
    ``EMU`` (the interpreter, whose dots of 16-bit operands are wrong) float32 holding the rounded values."""
    if DOT == "bf16":
        y = x.to(tl.bfloat16)
    elif DOT == "fp16":
        y = x.to(tl.float16)
    else:
        y = x.to(tl.float32)
    if EMU:
        y = y.to(tl.float32)
    return y


@triton.jit
def mm(a, b, acc, SA: tl.constexpr, SB: tl.constexpr, DOT: tl.constexpr, EMU: tl.constexpr, PREC: tl.constexpr):
    """``acc + a @ b`` (float32 accumulation) with operands rounded to ``DOT``. A float32 operand flagged ``SA``
    (``SB``) is split in a rounded high part and the rounded rest, one more product each: about float32 accuracy
    when the other operand is exact in ``DOT`` (an input tile). ``DOT == "fp32"``: one product at ``PREC``."""
    a_hi = rnd(a, DOT, EMU)
    b_hi = rnd(b, DOT, EMU)
    acc = tl.dot(a_hi, b_hi, acc, input_precision=PREC)
    if DOT != "fp32":
        if SA:
            acc = tl.dot(rnd(a - a_hi.to(tl.float32), DOT, EMU), b_hi, acc, input_precision=PREC)
        if SB:
            acc = tl.dot(a_hi, rnd(b - b_hi.to(tl.float32), DOT, EMU), acc, input_precision=PREC)
    return acc


@triton.jit
def gate(G, rows, cols, mask, i_hv, HV: tl.constexpr, GK: tl.constexpr):
    """Like :func:`tile` for the gates ``[R, HV, GK]``; a per-head gate (``GK == 1``) broadcast over ``cols``."""
    if GK == 1:
        b_g = tile(G, rows, cols * 0, mask, i_hv, HV, 1)
    else:
        b_g = tile(G, rows, cols, mask, i_hv, HV, GK)
    return b_g


@triton.jit
def state_at(X, i_s, i_hv, o_k, o_v, m_k, m_v, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr):
    """Tile ``[len(o_k), len(o_v)]`` of state ``i_s`` of a ``[*, HV, DK, DV]`` array, in its dtype (float32, or
    bfloat16 where the gdr backward stores its states); pass ``o_k[None, :]`` and ``o_v[:, None]`` for the
    transposed tile; masked elements 0."""
    base = (i_s.to(tl.int64) * HV + i_hv) * (DK * DV)
    return tl.load(X + base + o_k * DV + o_v, mask=m_k & m_v, other=0.0)


@triton.jit
def exclusive_cumsum(x, N: tl.constexpr):
    """``sum_{s < t} x_s`` along axis 0 of ``x [N, *]`` (float32, ``N >= 16``): a product with the strictly lower 0/1
    matrix at float32 precision, not the inclusive sum minus ``x_t``, which rounds away the small sums before a
    large ``x_t`` (the gates' gradients under strong gates: ``x_t`` is what row ``t`` passes to the chunk's state,
    about 1 at the last row, its predecessors' much less)."""
    o = tl.arange(0, N)
    return tl.dot((o[None, :] < o[:, None]).to(tl.float32), x, input_precision="ieee")


@triton.jit
def level(o_t, n_rows, S):
    """Level ``S`` of the pairs ``i > j`` of a block (``o_t``: its rows, the first ``n_rows`` valid): rows in
    groups of ``2 S``, each group's reference row ``ref`` its ``S``-th; the level holds the pairs of one group with
    ``i >= ref > j``, for which ``exp(b_i - b_j) = exp(b_i - b_ref) exp(b_ref - b_j)``, both exponents <= 0: one
    product per level. Every pair ``i > j`` is in exactly one level (``S`` the highest bit where ``i`` and ``j``
    differ). Returns ``(ref, up, lo)``: the reference row of each row's group, the valid rows at or past it, the
    rows before it (whose reference is a valid row)."""
    ref = (o_t // (2 * S)) * (2 * S) + S
    up = (o_t >= ref) & (o_t < n_rows)
    lo = (o_t < ref) & (ref < n_rows)
    return ref, up, lo


# ------------------------------------------------------------------------------------------------
# Forward.
# ------------------------------------------------------------------------------------------------


@triton.jit
def walk_program(i_p, Cu, ChunkOff, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Program ``i_p = (i_n * NK + i_k) * NV + i_v`` of a state walk (``NK``, ``NV``: the state's key and value
    blocks): sequence ``i_n``, its rows ``[bos, eos)`` and chunks ``[c0, c0 + n_chunks)``, and the key rows ``o_k``
    and value columns ``o_v`` of its ``[BK, BV]`` state tile."""
    NK: tl.constexpr = (DK + BK - 1) // BK
    NV: tl.constexpr = (DV + BV - 1) // BV
    i_n = i_p // (NK * NV)
    i_k = (i_p // NV) % NK
    i_v = i_p % NV
    bos = tl.load(Cu + i_n).to(tl.int64)
    eos = tl.load(Cu + i_n + 1).to(tl.int64)
    c0 = tl.load(ChunkOff + i_n)
    n_chunks = tl.load(ChunkOff + i_n + 1) - c0
    return i_n, bos, eos, c0, n_chunks, i_k * BK + tl.arange(0, BK), i_v * BV + tl.arange(0, BV)


@triton.jit
def chunk_gate_cumsum(
    G,
    Cu,
    ChunkSeq,
    ChunkOff,
    GC,
    HV: tl.constexpr,
    GK: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
):
    """``GC``: the cumulative sum of the gates from each chunk's start (float32). Grid ``(NT, HV, cdiv(GK, BK))``."""
    i_t, i_hv, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    _, bos, n_rows = chunk_span(Cu, ChunkSeq, ChunkOff, i_t, BT)
    o_t = tl.arange(0, BT)
    rows = bos + o_t
    o_k = i_k * BK + tl.arange(0, BK)
    mask = (o_t < n_rows)[:, None] & (o_k < GK)[None, :]
    b_g = tile(G, rows[:, None], o_k[None, :], mask, i_hv, HV, GK)  # [BT, BK]
    b_g = tl.cumsum(b_g, axis=0)
    tl.store(GC + (rows[:, None] * HV + i_hv) * GK + o_k[None, :], b_g, mask=mask)


@triton.jit
def state_walk_fwd(
    K_,
    V_,
    GC,
    GV,
    H0,
    Cu,
    ChunkOff,
    Hs,
    HT,
    i_p,
    i_hv,
    H: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    GK: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_H0: tl.constexpr,
    HAS_GV: tl.constexpr,
    SPLIT: tl.constexpr,
    DECAYED: tl.constexpr,
    PREC: tl.constexpr,
    DOT: tl.constexpr,
    EMU: tl.constexpr,
):
    """Program ``(i_p, i_hv)`` of :func:`chunk_state_fwd`: the state at each chunk's start (``Hs``) and after the
    last (``HT``), one ``[BK, BV]`` tile, in registers across the chunks. ``SPLIT``: the chunk's update keeps float32
    accuracy (its float32 operand split, :func:`mm`), for a final state that is returned or states that feed float32
    products; else one product (the states then only feed dots that round them to ``DOT``). ``HAS_GV``: the state's
    columns decay too, by the cumulative gates ``GV [R, HV, DV]`` (``S <- diag(exp(b_L)) S diag(exp(c_L)) + (k
    exp(b_L - b))^T (v exp(c_L - c))``, ``c`` = ``GV``). ``DECAYED`` (neither ``SPLIT`` nor ``HAS_GV``): ``K_`` holds
    the decayed keys ``k exp(b_L - b) [R, HV, DK]`` in the dots' operand dtype (:func:`chunk_intra_diag`'s ``KD``:
    the values this walk would round them to), so it reads them and the chunks' last gates instead of ``k`` and the
    float32 gate tile: 0.8 GB instead of 1.34 at B2 T16384 H16 K=V=128, the same states."""
    tl.static_assert(not (DECAYED and (SPLIT or HAS_GV)), "decayed keys are rounded: no SPLIT, no GV")
    SPLIT_V: tl.constexpr = SPLIT and HAS_GV  # decayed values are not exact in DOT either
    i_n, bos, eos, c0, n_chunks, o_k, o_v = walk_program(i_p, Cu, ChunkOff, DK, DV, BK, BV)
    i_h = i_hv // (HV // H)
    o_t = tl.arange(0, BT)
    m_k = o_k < DK
    m_v = o_v < DV
    m_h = m_k[:, None] & m_v[None, :]
    p_off = o_k[:, None] * DV + o_v[None, :]

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        b_h += state_at(H0, i_n, i_hv, o_k[:, None], o_v[None, :], m_k[:, None], m_v[None, :], HV, DK, DV)
    for i_c in range(n_chunks):
        i_t = c0 + i_c
        tl.store(Hs + (i_t.to(tl.int64) * HV + i_hv) * (DK * DV) + p_off, b_h.to(Hs.dtype.element_ty), mask=m_h)
        start = bos + i_c * BT
        n_rows = tl.minimum(eos - start, BT)
        rows = start + o_t
        m_t = o_t < n_rows
        m_kt = m_k[:, None] & m_t[None, :]
        b_gl = gate(GC, start + n_rows - 1, o_k, m_k, i_hv, HV, GK)  # [BK], the chunk's total decay
        if DECAYED:
            b_kd = raw(K_, rows[None, :], o_k[:, None], m_kt, i_hv, HV, DK, EMU)  # [BK, BT], k exp(b_L - b)
        else:
            b_kT = tile(K_, rows[None, :], o_k[:, None], m_kt, i_h, H, DK)  # [BK, BT]
            b_gT = gate(GC, rows[None, :], o_k[:, None], m_kt, i_hv, HV, GK)  # [BK, BT]
            b_kd = b_kT * tl.exp(b_gl[:, None] - b_gT)
        b_v = raw(V_, rows[:, None], o_v[None, :], m_t[:, None] & m_v[None, :], i_hv, HV, DV, EMU)  # [BT, BV]
        if HAS_GV:
            b_cl = gate(GV, start + n_rows - 1, o_v, m_v, i_hv, HV, DV)  # [BV]
            b_c = gate(GV, rows[:, None], o_v[None, :], m_t[:, None] & m_v[None, :], i_hv, HV, DV)  # [BT, BV]
            b_v = b_v.to(tl.float32) * tl.exp(b_cl[None, :] - b_c)
            b_h = b_h * tl.exp(b_cl)[None, :]
        b_h = b_h * tl.exp(b_gl)[:, None]
        b_h = mm(b_kd, b_v, b_h, SPLIT, SPLIT_V, DOT, EMU, PREC)
    tl.store(HT + (i_n.to(tl.int64) * HV + i_hv) * (DK * DV) + p_off, b_h, mask=m_h)


@triton.jit
def chunk_state_fwd(
    K_,
    V_,
    GC,
    GV,
    H0,
    Cu,
    ChunkOff,
    Hs,
    HT,
    H: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    GK: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_H0: tl.constexpr,
    HAS_GV: tl.constexpr,
    SPLIT: tl.constexpr,
    DECAYED: tl.constexpr,
    PREC: tl.constexpr,
    DOT: tl.constexpr,
    EMU: tl.constexpr,
):
    """The state at each chunk's start (``Hs``) and after the last (``HT``), one ``[BK, BV]`` tile per program
    (:func:`state_walk_fwd`). Grid ``(N * cdiv(DK, BK) * cdiv(DV, BV), HV)``."""
    state_walk_fwd(
        K_,
        V_,
        GC,
        GV,
        H0,
        Cu,
        ChunkOff,
        Hs,
        HT,
        tl.program_id(0),
        tl.program_id(1),
        H,
        HV,
        DK,
        DV,
        GK,
        BT,
        BK,
        BV,
        HAS_H0,
        HAS_GV,
        SPLIT,
        DECAYED,
        PREC,
        DOT,
        EMU,
    )


@triton.jit
def chunk_intra_diag(
    Q,
    K_,
    GC,
    Cu,
    ChunkSeq,
    ChunkOff,
    scale,
    A,
    KD,
    H: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    GK: tl.constexpr,
    BT: tl.constexpr,
    BKD: tl.constexpr,
    BC: tl.constexpr,
    HAS_KD: tl.constexpr,
):
    """Diagonal block ``i_c`` (``[BC, BC]``) of the chunk's scores ``A`` (scale included) and the zero blocks right
    of it; :func:`chunk_intra_offdiag` then fills the blocks left of it. ``HAS_KD``: also the block's rows of the
    decayed keys ``KD [R, HV, DK] = k exp(b_L - b)`` (in ``KD``'s dtype: the forward's unsplit state walk reads them
    in place of ``k`` and the float32 gates, ``DECAYED`` of :func:`state_walk_fwd`; this program holds the rows'
    ``k`` and gates already). Element-wise over all ``BKD`` (``DK``
    padded) key channels, ``A_ij = sum_c q_ic k_jc exp(b_ic - b_jc)`` for ``i > j`` (the others kept out before
    the exponent), two columns per pass, one exponent per pair and channel: what a dot would save is lost to its
    levels (:func:`level`). Against one column per pass (all lanes, half of them above the diagonal) 267 us
    instead of 306 on the H200 (B4 T4096 H16 K=128 bf16, best warps of each;
    ``benchmarks/results/2026-12-05-h200-gla-intra-split.log``). Grid ``(NT, HV, BT / BC)``."""
    NC: tl.constexpr = BT // BC
    i_t, i_hv, i_c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    _, bos, n_rows = chunk_span(Cu, ChunkSeq, ChunkOff, i_t, BT)
    o_c = tl.arange(0, BC)
    ref = i_c * BC
    r_i = ref + o_c  # the block's rows (and columns) in the chunk
    m_i = r_i < n_rows
    p_a = A + ((i_t.to(tl.int64) * HV + i_hv) * BT + r_i) * BT  # [BC], the block's rows of A
    for i_j in range(i_c + 1, NC):
        tl.store(p_a[:, None] + i_j * BC + o_c[None, :], tl.zeros([BC, BC], dtype=A.dtype.element_ty))
    o_k = tl.arange(0, BKD)
    m_k = o_k < DK
    m_ik = m_i[:, None] & m_k[None, :]
    b_q = tile(Q, bos + r_i[:, None], o_k[None, :], m_ik, i_h, H, DK)  # [BC, BKD]
    b_g = gate(GC, bos + r_i[:, None], o_k[None, :], m_ik, i_hv, HV, GK)
    # The diagonal itself needs no exponent (b_ii - b_ii = 0); stored with the zeros right of it.
    b_k = tile(K_, bos + r_i[:, None], o_k[None, :], m_ik, i_h, H, DK)
    if HAS_KD:
        b_gl = gate(GC, bos + n_rows - 1, o_k, m_k & (o_k * 0 < n_rows), i_hv, HV, GK)  # the chunk's last row
        p_kd = KD + ((bos + r_i[:, None]) * HV + i_hv) * DK + o_k[None, :]
        tl.store(p_kd, (b_k * tl.exp(b_gl[None, :] - b_g)).to(KD.dtype.element_ty), mask=m_ik)
    b_d = tl.sum(b_q * b_k, axis=1) * scale
    up = o_c[None, :] >= o_c[:, None]
    b_u = tl.where(o_c[None, :] == o_c[:, None], b_d[:, None], 0.0)
    tl.store(p_a[:, None] + r_i[None, :], b_u.to(A.dtype.element_ty), mask=up)
    # Below it, columns j and BC - 2 - j share one pass: column j has rows j + 1 .. BC - 1 (lanes i > j), column
    # BC - 2 - j rows BC - 1 - j .. BC - 1 (lanes i <= j, row BC - 1 - i): BC lanes for the two, so half the
    # exponents of one column per pass over all lanes. The last pass (j = BC / 2 - 1 = BC - 2 - j) computes its
    # column twice, two lanes per row storing the same value.
    f_i = ref + BC - 1 - o_c  # the rows reversed
    m_f = f_i < n_rows
    m_fk = m_f[:, None] & m_k[None, :]
    b_qf = tile(Q, bos + f_i[:, None], o_k[None, :], m_fk, i_h, H, DK)
    b_gf = gate(GC, bos + f_i[:, None], o_k[None, :], m_fk, i_hv, HV, GK)
    p_0 = A + ((i_t.to(tl.int64) * HV + i_hv) * BT) * BT
    for j in range(BC // 2):
        c2 = BC - 2 - j
        m_j = m_k & (o_k * 0 + ref + j < n_rows)
        m_2 = m_k & (o_k * 0 + ref + c2 < n_rows)
        b_kj = tile(K_, bos + ref + j, o_k, m_j, i_h, H, DK)
        b_gj = gate(GC, bos + ref + j, o_k, m_j, i_hv, HV, GK)
        b_k2 = tile(K_, bos + ref + c2, o_k, m_2, i_h, H, DK)
        b_g2 = gate(GC, bos + ref + c2, o_k, m_2, i_hv, HV, GK)
        low = (o_c > j)[:, None]
        row = tl.where(o_c > j, r_i, f_i)  # [BC], the lane's row in the chunk
        col = tl.where(o_c > j, ref + j, ref + c2)
        m_e = tl.where(o_c > j, m_i, m_f)
        b_e = tl.exp(
            tl.where(
                m_e[:, None],
                tl.where(low, b_g, b_gf) - tl.where(low, b_gj[None, :], b_g2[None, :]),
                float("-inf"),
            )
        )
        b_s = tl.sum(tl.where(low, b_q, b_qf) * tl.where(low, b_kj[None, :], b_k2[None, :]) * b_e, axis=1)
        tl.store(p_0 + row * BT + col, (b_s * scale).to(A.dtype.element_ty))


@triton.jit
def chunk_intra_offdiag(
    Q,
    K_,
    GC,
    Cu,
    ChunkSeq,
    ChunkOff,
    scale,
    A_in,
    A,
    H: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    GK: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BC: tl.constexpr,
    PREC: tl.constexpr,
    DOT: tl.constexpr,
    EMU: tl.constexpr,
):
    """Block ``(i_i, i_j)``, ``i_i > i_j``, of the chunk's scores ``A`` (scale included), stored into
    :func:`chunk_intra_diag`'s ``A`` (``A_in``, aliased; its other blocks kept). One product, the gates referred to
    the first row ``r`` of block ``i_i``: ``(q_i exp(b_i - b_r)) . (k_j exp(b_r - b_j))``, both exponents <= 0
    (``j < r <= i``); a block past the chunk's valid rows is zeros (its ``r`` is no row). Grid ``(NT, HV,
    NC (NC - 1) / 2)``, ``NC = BT / BC``: the pairs row by row, ``(1, 0), (2, 0), (2, 1), ...``."""
    NC: tl.constexpr = BT // BC
    i_t, i_hv, i_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_i = 1  # row i_i starts at pair i_i (i_i - 1) / 2
    for r in tl.static_range(2, NC):
        i_i += (i_p >= r * (r - 1) // 2).to(tl.int32)
    i_j = i_p - i_i * (i_i - 1) // 2
    i_h = i_hv // (HV // H)
    _, bos, n_rows = chunk_span(Cu, ChunkSeq, ChunkOff, i_t, BT)
    o_c = tl.arange(0, BC)
    r_i = i_i * BC + o_c  # the block's rows and columns in the chunk
    r_j = i_j * BC + o_c
    m_i = r_i < n_rows
    m_j = r_j < n_rows
    ref = i_i * BC

    b_a = tl.zeros([BC, BC], dtype=tl.float32)
    if ref < n_rows:
        for i_k in range(tl.cdiv(DK, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < DK
            m_ik = m_i[:, None] & m_k[None, :]
            m_kj = m_k[:, None] & m_j[None, :]
            b_q = tile(Q, bos + r_i[:, None], o_k[None, :], m_ik, i_h, H, DK)  # [BC, BK]
            b_g = gate(GC, bos + r_i[:, None], o_k[None, :], m_ik, i_hv, HV, GK)
            b_kT = tile(K_, bos + r_j[None, :], o_k[:, None], m_kj, i_h, H, DK)  # [BK, BC]
            b_gT = gate(GC, bos + r_j[None, :], o_k[:, None], m_kj, i_hv, HV, GK)
            b_r = gate(GC, bos + ref, o_k, m_k, i_hv, HV, GK)  # [BK]
            b_qs = b_q * tl.exp(tl.where(m_ik, b_g - b_r[None, :], float("-inf")))
            b_ks = b_kT * tl.exp(tl.where(m_kj, b_r[:, None] - b_gT, float("-inf")))
            b_a = mm(b_qs, b_ks, b_a, 1, 1, DOT, EMU, PREC)
    p_a = A + ((i_t.to(tl.int64) * HV + i_hv) * BT + r_i[:, None]) * BT + r_j[None, :]
    tl.store(p_a, (b_a * scale).to(A.dtype.element_ty))


@triton.jit
def chunk_output(
    Q,
    V_,
    GC,
    Hs,
    A,
    Cu,
    ChunkSeq,
    ChunkOff,
    scale,
    O,
    H: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    GK: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    PREC: tl.constexpr,
    DOT: tl.constexpr,
    EMU: tl.constexpr,
):
    """``o = scale (q * exp(b)) @ h + A @ v`` for one chunk and value block. Grid ``(NT * cdiv(DV, BV), HV)``."""
    NV: tl.constexpr = (DV + BV - 1) // BV
    i_p, i_hv = tl.program_id(0), tl.program_id(1)  # the value blocks of one chunk side by side (shared reads)
    i_t = i_p // NV
    i_v = i_p % NV
    i_h = i_hv // (HV // H)
    _, bos, n_rows = chunk_span(Cu, ChunkSeq, ChunkOff, i_t, BT)
    o_t = tl.arange(0, BT)
    m_t = o_t < n_rows
    rows = bos + o_t
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < DV

    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(tl.cdiv(DK, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < DK
        m_tk = m_t[:, None] & m_k[None, :]
        b_q = tile(Q, rows[:, None], o_k[None, :], m_tk, i_h, H, DK)  # [BT, BK]
        b_g = gate(GC, rows[:, None], o_k[None, :], m_tk, i_hv, HV, GK)
        b_h = state_at(Hs, i_t, i_hv, o_k[:, None], o_v[None, :], m_k[:, None], m_v[None, :], HV, DK, DV)
        b_o = mm(b_q * tl.exp(b_g), b_h, b_o, 0, 0, DOT, EMU, PREC)
    b_a = tl.load(A + ((i_t.to(tl.int64) * HV + i_hv) * BT + o_t[:, None]) * BT + o_t[None, :])  # [BT, BT]
    b_v = raw(V_, rows[:, None], o_v[None, :], m_t[:, None] & m_v[None, :], i_hv, HV, DV, EMU)
    b_o = mm(b_a, b_v, b_o * scale, 0, 0, DOT, EMU, PREC)
    p_o = O + (rows[:, None] * HV + i_hv) * DV + o_v[None, :]
    tl.store(p_o, b_o.to(O.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])


# ------------------------------------------------------------------------------------------------
# Backward.
# ------------------------------------------------------------------------------------------------


@triton.jit
def state_walk_bwd(
    Q,
    DO,
    GC,
    GV,
    DHT,
    Cu,
    ChunkOff,
    scale,
    DHE,
    DH0,
    i_p,
    i_hv,
    H: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    GK: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_DHT: tl.constexpr,
    HAS_GV: tl.constexpr,
    PREC: tl.constexpr,
    DOT: tl.constexpr,
    EMU: tl.constexpr,
):
    """Program ``(i_p, i_hv)`` of :func:`chunk_state_bwd`: the gradient of the state, chunks in reverse: ``DHE`` at
    each chunk's end, ``DH0`` before the first (the final state's cotangent ``DHT`` for an empty sequence).
    ``HAS_GV``: the columns decay too (``GV``, as :func:`state_walk_fwd`'s): ``dS <- diag(exp(b_L)) dS diag(exp(c_L))
    + scale (q exp(b))^T (do exp(c))``."""
    i_n, bos, eos, c0, n_chunks, o_k, o_v = walk_program(i_p, Cu, ChunkOff, DK, DV, BK, BV)
    i_h = i_hv // (HV // H)
    o_t = tl.arange(0, BT)
    m_k = o_k < DK
    m_v = o_v < DV
    m_h = m_k[:, None] & m_v[None, :]
    p_off = o_k[:, None] * DV + o_v[None, :]

    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        b_dh += state_at(DHT, i_n, i_hv, o_k[:, None], o_v[None, :], m_k[:, None], m_v[None, :], HV, DK, DV)
    for i_r in range(n_chunks):
        i_c = n_chunks - 1 - i_r
        i_t = c0 + i_c
        tl.store(DHE + (i_t.to(tl.int64) * HV + i_hv) * (DK * DV) + p_off, b_dh, mask=m_h)
        start = bos + i_c * BT
        n_rows = tl.minimum(eos - start, BT)
        rows = start + o_t
        m_t = o_t < n_rows
        m_kt = m_k[:, None] & m_t[None, :]
        b_qT = tile(Q, rows[None, :], o_k[:, None], m_kt, i_h, H, DK)  # [BK, BT]
        b_gT = gate(GC, rows[None, :], o_k[:, None], m_kt, i_hv, HV, GK)
        b_gl = gate(GC, start + n_rows - 1, o_k, m_k, i_hv, HV, GK)  # [BK]
        b_do = raw(DO, rows[:, None], o_v[None, :], m_t[:, None] & m_v[None, :], i_hv, HV, DV, EMU)  # [BT, BV]
        if HAS_GV:
            b_cl = gate(GV, start + n_rows - 1, o_v, m_v, i_hv, HV, DV)  # [BV]
            b_c = gate(GV, rows[:, None], o_v[None, :], m_t[:, None] & m_v[None, :], i_hv, HV, DV)  # [BT, BV]
            b_do = b_do.to(tl.float32) * tl.exp(b_c)
            b_dh = b_dh * tl.exp(b_cl)[None, :]
        b_dh = b_dh * tl.exp(b_gl)[:, None]
        b_dh = mm(b_qT * (tl.exp(b_gT) * scale), b_do, b_dh, 1, HAS_GV, DOT, EMU, PREC)
    tl.store(DH0 + (i_n.to(tl.int64) * HV + i_hv) * (DK * DV) + p_off, b_dh, mask=m_h)


@triton.jit
def chunk_state_bwd(
    Q,
    DO,
    GC,
    GV,
    DHT,
    Cu,
    ChunkOff,
    scale,
    DHE,
    DH0,
    H: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    GK: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_DHT: tl.constexpr,
    HAS_GV: tl.constexpr,
    PREC: tl.constexpr,
    DOT: tl.constexpr,
    EMU: tl.constexpr,
):
    """The gradient of the state, chunks in reverse (:func:`state_walk_bwd`). Grid ``(N * cdiv(DK, BK) * cdiv(DV,
    BV), HV)``."""
    state_walk_bwd(
        Q,
        DO,
        GC,
        GV,
        DHT,
        Cu,
        ChunkOff,
        scale,
        DHE,
        DH0,
        tl.program_id(0),
        tl.program_id(1),
        H,
        HV,
        DK,
        DV,
        GK,
        BT,
        BK,
        BV,
        HAS_DHT,
        HAS_GV,
        PREC,
        DOT,
        EMU,
    )


@triton.jit
def chunk_state_pair(
    K_,
    V_,
    Q,
    DO,
    GC,
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
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    GK: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_H0: tl.constexpr,
    HAS_DHT: tl.constexpr,
    PREC: tl.constexpr,
    DOT: tl.constexpr,
    EMU: tl.constexpr,
):
    """The backward's two state walks in one launch: :func:`chunk_state_fwd` (float32 states, ``SPLIT``) over the
    first half of the grid's first axis and :func:`chunk_state_bwd` over the second, each program one tile of one of
    them. They are independent (inputs only), and each program is a chain of dependent chunk steps, so two launches
    of about one program per SM take the sum of two chains; one launch holds both chains on the SMs at once. No
    value gate (``gla``). Grid ``(2 * N * cdiv(DK, BK) * cdiv(DV, BV), HV)``."""
    half = tl.num_programs(0) // 2
    i_p, i_hv = tl.program_id(0), tl.program_id(1)
    if i_p < half:
        state_walk_fwd(
            K_,
            V_,
            GC,
            GC,
            H0,
            Cu,
            ChunkOff,
            Hs,
            HT,
            i_p,
            i_hv,
            H,
            HV,
            DK,
            DV,
            GK,
            BT,
            BK,
            BV,
            HAS_H0,
            False,
            True,
            False,
            PREC,
            DOT,
            EMU,
        )
    else:
        state_walk_bwd(
            Q,
            DO,
            GC,
            GC,
            DHT,
            Cu,
            ChunkOff,
            scale,
            DHE,
            DH0,
            i_p - half,
            i_hv,
            H,
            HV,
            DK,
            DV,
            GK,
            BT,
            BK,
            BV,
            HAS_DHT,
            False,
            PREC,
            DOT,
            EMU,
        )


@triton.jit
def chunk_attn_grad(
    DO,
    V_,
    Cu,
    ChunkSeq,
    ChunkOff,
    scale,
    DA,
    HV: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    BV: tl.constexpr,
    PREC: tl.constexpr,
    DOT: tl.constexpr,
    EMU: tl.constexpr,
):
    """``dA = scale do @ v^T`` on and below the diagonal (zeros elsewhere). Grid ``(NT, HV)``."""
    i_t, i_hv = tl.program_id(0), tl.program_id(1)
    _, bos, n_rows = chunk_span(Cu, ChunkSeq, ChunkOff, i_t, BT)
    o_t = tl.arange(0, BT)
    m_t = o_t < n_rows
    rows = bos + o_t
    b_da = tl.zeros([BT, BT], dtype=tl.float32)
    for i_v in range(tl.cdiv(DV, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < DV
        b_do = raw(DO, rows[:, None], o_v[None, :], m_t[:, None] & m_v[None, :], i_hv, HV, DV, EMU)  # [BT, BV]
        b_vT = raw(V_, rows[None, :], o_v[:, None], m_v[:, None] & m_t[None, :], i_hv, HV, DV, EMU)  # [BV, BT]
        b_da = mm(b_do, b_vT, b_da, 0, 0, DOT, EMU, PREC)
    m_a = (o_t[:, None] >= o_t[None, :]) & m_t[:, None]
    p_da = DA + ((i_t.to(tl.int64) * HV + i_hv) * BT + o_t[:, None]) * BT + o_t[None, :]
    tl.store(p_da, tl.where(m_a, b_da * scale, 0.0))


@triton.jit
def chunk_dv(
    K_,
    GC,
    DO,
    A,
    DHE,
    Cu,
    ChunkSeq,
    ChunkOff,
    DV_,
    H: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    GK: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    PREC: tl.constexpr,
    DOT: tl.constexpr,
    EMU: tl.constexpr,
):
    """``dv = A^T @ do + (k * exp(b_L - b)) @ dhe`` (``dv``'s dtype). Grid ``(NT * cdiv(DV, BV), HV)``."""
    NV: tl.constexpr = (DV + BV - 1) // BV
    i_p, i_hv = tl.program_id(0), tl.program_id(1)  # the value blocks of one chunk side by side (shared reads)
    i_t = i_p // NV
    i_v = i_p % NV
    i_h = i_hv // (HV // H)
    _, bos, n_rows = chunk_span(Cu, ChunkSeq, ChunkOff, i_t, BT)
    o_t = tl.arange(0, BT)
    m_t = o_t < n_rows
    rows = bos + o_t
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < DV
    m_tv = m_t[:, None] & m_v[None, :]

    b_aT = tl.load(A + ((i_t.to(tl.int64) * HV + i_hv) * BT + o_t[None, :]) * BT + o_t[:, None])  # [j, i] = A[i, j]
    b_do = raw(DO, rows[:, None], o_v[None, :], m_tv, i_hv, HV, DV, EMU)  # [BT, BV]
    b_dv = mm(b_aT, b_do, tl.zeros([BT, BV], dtype=tl.float32), 0, 0, DOT, EMU, PREC)
    for i_k in range(tl.cdiv(DK, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < DK
        m_tk = m_t[:, None] & m_k[None, :]
        b_k = tile(K_, rows[:, None], o_k[None, :], m_tk, i_h, H, DK)  # [BT, BK]
        b_g = gate(GC, rows[:, None], o_k[None, :], m_tk, i_hv, HV, GK)
        b_gl = gate(GC, bos + n_rows - 1, o_k, m_k & (o_k * 0 < n_rows), i_hv, HV, GK)  # [BK]
        b_dhe = state_at(DHE, i_t, i_hv, o_k[:, None], o_v[None, :], m_k[:, None], m_v[None, :], HV, DK, DV)
        b_dv = mm(b_k * tl.exp(b_gl[None, :] - b_g), b_dhe, b_dv, 0, 0, DOT, EMU, PREC)
    tl.store(DV_ + (rows[:, None] * HV + i_hv) * DV + o_v[None, :], b_dv.to(DV_.dtype.element_ty), mask=m_tv)


@triton.jit
def chunk_dqk_intra(
    Q,
    K_,
    GC,
    DA,
    Cu,
    ChunkSeq,
    ChunkOff,
    DQ,
    DK_,
    H: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    GK: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BC: tl.constexpr,
    LEVELS: tl.constexpr,
    PREC: tl.constexpr,
    DOT: tl.constexpr,
    EMU: tl.constexpr,
):
    """The intra-chunk shares of ``dq`` and ``dk`` (float32, per value head) for one block of ``BC`` rows ``c`` and
    key tile, without the pairs ``i == j`` (:func:`chunk_dqk_inter` adds them): ``dq_i = sum_{j < i} dA_ij k_j
    exp(b_i - b_j)``, ``dk_j = sum_{i > j} dA_ij q_i exp(b_i - b_j)``. With ``r`` the first row of ``c``: ``dq_c =
    exp(b_c - b_r) * sum_{blocks j before} dA_cj (k_j exp(b_r - b_j))``; ``dk_c = sum_{blocks i after} exp(b_ri -
    b_c) * (dA_ic^T (q_i exp(b_i - b_ri)))``, ``r_i`` the first row of block ``i`` (only blocks with valid rows:
    their ``r_i`` is one); the block's own pairs in ``LEVELS = log2(BC)`` levels (:func:`level`: ``dq += u * (dA_S
    @ (k w))``, ``dk += w * (dA_S^T @ (q u))``, ``u = exp(b - b_ref)`` past each group's reference, ``w = exp(b_ref
    - b)`` before it). Every exponent <= 0. Grid ``(NT * (BT / BC) * cdiv(DK, BK), HV)``."""
    NK: tl.constexpr = (DK + BK - 1) // BK
    NC: tl.constexpr = BT // BC
    i_p, i_hv = tl.program_id(0), tl.program_id(1)  # the blocks of one chunk side by side (shared reads)
    i_t = i_p // (NC * NK)
    i_c = (i_p // NK) % NC
    i_k = i_p % NK
    i_h = i_hv // (HV // H)
    _, bos, n_rows = chunk_span(Cu, ChunkSeq, ChunkOff, i_t, BT)
    ref = i_c * BC
    o_c = tl.arange(0, BC)
    r_c = ref + o_c
    m_c = r_c < n_rows
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < DK
    m_ck = m_c[:, None] & m_k[None, :]
    p_da = DA + (i_t.to(tl.int64) * HV + i_hv) * BT * BT
    b_g = gate(GC, bos + r_c[:, None], o_k[None, :], m_ck, i_hv, HV, GK)  # [BC, BK]
    b_q = tile(Q, bos + r_c[:, None], o_k[None, :], m_ck, i_h, H, DK)
    b_k = tile(K_, bos + r_c[:, None], o_k[None, :], m_ck, i_h, H, DK)
    n_blocks = tl.cdiv(n_rows, BC)  # blocks with valid rows

    # dq from the blocks before (none when this block has no valid row, so b_ref is a row's gate)
    b_dq = tl.zeros([BC, BK], dtype=tl.float32)
    b_ref = gate(GC, bos + ref, o_k, m_k, i_hv, HV, GK)  # [BK]
    for i_j in range(tl.where(ref < n_rows, i_c, 0)):
        r_j = i_j * BC + o_c  # all valid
        m_jk = (r_j < n_rows)[:, None] & m_k[None, :]
        b_gj = gate(GC, bos + r_j[:, None], o_k[None, :], m_jk, i_hv, HV, GK)
        b_kw = tile(K_, bos + r_j[:, None], o_k[None, :], m_jk, i_h, H, DK) * tl.exp(
            tl.where(m_jk, b_ref[None, :] - b_gj, float("-inf"))
        )
        b_da = tl.load(p_da + r_c[:, None] * BT + r_j[None, :])  # [BC, BC] (dA is stored whole)
        b_dq = mm(b_da, b_kw, b_dq, 1, 1, DOT, EMU, PREC)
    b_dq = b_dq * tl.exp(tl.where(m_ck, b_g - b_ref[None, :], float("-inf")))

    # dk from the blocks after that have valid rows, each referred to its own first row
    b_dk = tl.zeros([BC, BK], dtype=tl.float32)
    for i_i in range(i_c + 1, n_blocks):
        r_i = i_i * BC + o_c
        m_ik = (r_i < n_rows)[:, None] & m_k[None, :]
        b_ri = gate(GC, bos + i_i * BC, o_k, m_k, i_hv, HV, GK)  # [BK]
        b_gi = gate(GC, bos + r_i[:, None], o_k[None, :], m_ik, i_hv, HV, GK)
        b_qu = tile(Q, bos + r_i[:, None], o_k[None, :], m_ik, i_h, H, DK) * tl.exp(
            tl.where(m_ik, b_gi - b_ri[None, :], float("-inf"))
        )
        b_daT = tl.load(p_da + r_i[None, :] * BT + r_c[:, None])  # [BC, BC], [c, i] = dA[i, c]
        b_p = mm(b_daT, b_qu, tl.zeros([BC, BK], dtype=tl.float32), 1, 1, DOT, EMU, PREC)
        b_dk += tl.exp(tl.where(m_ck, b_ri[None, :] - b_g, float("-inf"))) * b_p

    # the block's own pairs, level by level
    n_local = n_rows - ref  # valid rows of the block (may be <= 0)
    for lv in range(LEVELS):
        S = BC >> (lv + 1)
        ref_l, up, lo = level(o_c, n_local, S)
        m_uk = up[:, None] & m_k[None, :]
        m_lk = lo[:, None] & m_k[None, :]
        b_r = gate(GC, bos + ref + ref_l[:, None], o_k[None, :], m_uk | m_lk, i_hv, HV, GK)
        # u = exp(b - b_ref) past the reference, w = exp(b_ref - b) before it: other rows, so one exp for both
        b_e = tl.exp(tl.where(m_uk, b_g - b_r, tl.where(m_lk, b_r - b_g, float("-inf"))))
        b_u = tl.where(m_uk, b_e, 0.0)
        b_w = tl.where(m_lk, b_e, 0.0)
        m_s = (o_c[:, None] // (2 * S)) == (o_c[None, :] // (2 * S))  # the level's groups (symmetric)
        b_da = tl.load(p_da + r_c[:, None] * BT + r_c[None, :], mask=m_s, other=0.0)  # [i, j]
        b_daT = tl.load(p_da + r_c[None, :] * BT + r_c[:, None], mask=m_s, other=0.0)  # [j, i] = dA[i, j]
        b_dq += b_u * mm(b_da, b_k * b_w, tl.zeros([BC, BK], dtype=tl.float32), 1, 1, DOT, EMU, PREC)
        b_dk += b_w * mm(b_daT, b_q * b_u, tl.zeros([BC, BK], dtype=tl.float32), 1, 1, DOT, EMU, PREC)

    p_x = ((bos + r_c)[:, None] * HV + i_hv) * DK + o_k[None, :]
    tl.store(DQ + p_x, b_dq, mask=m_ck)
    tl.store(DK_ + p_x, b_dk, mask=m_ck)


@triton.jit
def chunk_dqk_inter(
    Q,
    K_,
    V_,
    GC,
    GV,
    DO,
    Hs,
    DHE,
    DQI,
    DKI,
    DA,
    Cu,
    ChunkSeq,
    ChunkOff,
    scale,
    DQ,
    DK_,
    DG,
    H: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    GK: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_GV: tl.constexpr,
    PREC: tl.constexpr,
    DOT: tl.constexpr,
    EMU: tl.constexpr,
):
    """``dq = scale (do @ h^T) * exp(b) + dq_intra``, ``dk = (v @ dhe^T) * exp(b_L - b) + dk_intra`` and the
    gates' gradient (float32, per value head; ``GK == DK``), chunk by chunk: for row ``t``

        dg_t = sum_{s >= t} (q_s dq_s - k_s dk_intra_s) + sum_{s < t} k_s dk_inter_s + exp(b_L) sum_v h dhe

    (the chunk's rows ``s``; ``h`` the state at its start, ``dhe`` the gradient of the state at its end). The last
    two terms are what ``g_t`` does through the state at the chunk's end: summed forward, they are not the small
    difference of large terms that a reverse cumulative sum of ``q dq - k dk`` over the whole sequence would take
    with strong gates. The pairs ``i == j`` of the intra-chunk scores (not in ``dq_intra``/``dk_intra``) cancel
    in ``dg`` exactly: they are added to ``dq`` and ``dk`` only. ``HAS_GV`` (the value-gated recurrence with a key
    gate, ``ejkernel_triton._value_chunk``): the states' columns decay by the cumulative gates ``c = GV [R, HV,
    DV]`` too, so ``do`` reads ``do exp(c)``, ``v`` reads ``v exp(c_L - c)`` and ``exp(b_L) sum_v h dhe`` weighs
    each column by ``exp(c_L)``; ``Hs``, ``DHE`` are then stored transposed, ``[NT, HV, DV, DK]`` (that path's
    layout). Grid ``(NT * cdiv(DK, BK), HV)``."""
    NK: tl.constexpr = (DK + BK - 1) // BK
    i_p, i_hv = tl.program_id(0), tl.program_id(1)  # the key blocks of one chunk side by side (shared reads)
    i_t = i_p // NK
    i_k = i_p % NK
    i_h = i_hv // (HV // H)
    _, bos, n_rows = chunk_span(Cu, ChunkSeq, ChunkOff, i_t, BT)
    o_t = tl.arange(0, BT)
    m_t = o_t < n_rows
    rows = bos + o_t
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < DK
    m_tk = m_t[:, None] & m_k[None, :]

    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_hdh = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(tl.cdiv(DV, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < DV
        m_tv = m_t[:, None] & m_v[None, :]
        b_do = raw(DO, rows[:, None], o_v[None, :], m_tv, i_hv, HV, DV, EMU)  # [BT, BV]
        b_v = raw(V_, rows[:, None], o_v[None, :], m_tv, i_hv, HV, DV, EMU)
        if HAS_GV:
            b_c = gate(GV, rows[:, None], o_v[None, :], m_tv, i_hv, HV, DV)  # [BT, BV]
            b_cl = gate(GV, bos + n_rows - 1, o_v, m_v & (o_v * 0 < n_rows), i_hv, HV, DV)  # [BV]
            b_do = b_do.to(tl.float32) * tl.exp(b_c)
            b_v = b_v.to(tl.float32) * tl.exp(b_cl[None, :] - b_c)
            b_hT = state_at(Hs, i_t, i_hv, o_v[:, None], o_k[None, :], m_v[:, None], m_k[None, :], HV, DV, DK)
            b_dheT = state_at(DHE, i_t, i_hv, o_v[:, None], o_k[None, :], m_v[:, None], m_k[None, :], HV, DV, DK)
        else:  # [BV, BK] tiles of the [DK, DV] states
            b_hT = state_at(Hs, i_t, i_hv, o_k[None, :], o_v[:, None], m_k[None, :], m_v[:, None], HV, DK, DV)
            b_dheT = state_at(DHE, i_t, i_hv, o_k[None, :], o_v[:, None], m_k[None, :], m_v[:, None], HV, DK, DV)
        b_dq = mm(b_do, b_hT, b_dq, HAS_GV, 1, DOT, EMU, PREC)
        b_dk = mm(b_v, b_dheT, b_dk, HAS_GV, 1, DOT, EMU, PREC)
        if HAS_GV:
            b_hdh += tl.sum(b_hT * b_dheT * tl.exp(b_cl)[:, None], axis=0)
        else:
            b_hdh += tl.sum(b_hT * b_dheT, axis=0)
    b_g = gate(GC, rows[:, None], o_k[None, :], m_tk, i_hv, HV, GK)  # [BT, BK]
    b_gl = gate(GC, bos + n_rows - 1, o_k, m_k & (o_k * 0 < n_rows), i_hv, HV, GK)  # [BK]
    p_x = (rows[:, None] * HV + i_hv) * DK + o_k[None, :]
    b_dq = b_dq * (tl.exp(b_g) * scale) + tl.load(DQI + p_x, mask=m_tk, other=0.0)
    b_dk = b_dk * tl.exp(b_gl[None, :] - b_g)  # the inter-chunk share
    b_dki = tl.load(DKI + p_x, mask=m_tk, other=0.0)
    b_q = tile(Q, rows[:, None], o_k[None, :], m_tk, i_h, H, DK)
    b_k = tile(K_, rows[:, None], o_k[None, :], m_tk, i_h, H, DK)
    b_u = b_q * b_dq - b_k * b_dki
    b_w = b_k * b_dk
    b_dd = tl.load(DA + ((i_t.to(tl.int64) * HV + i_hv) * BT + o_t) * BT + o_t)[:, None]  # dA_ii, [BT, 1]
    # Without HAS_GV dq and dk are stored before the cumulative sums, so that q, k and their gradients are not
    # live there (ptxas for sm_90, bf16 K=V=128, 64-key tiles: 255 -> 184 registers); with it, summed before and
    # stored after them (852 bytes spilled at 4 warps; 1244 when both came after, 2008 when stored before)
    if not HAS_GV:
        tl.store(DQ + p_x, (b_dq + b_dd * b_k).to(DQ.dtype.element_ty), mask=m_tk)
        tl.store(DK_ + p_x, (b_dk + b_dki + b_dd * b_q).to(DK_.dtype.element_ty), mask=m_tk)
        b_dg = tl.cumsum(b_u, axis=0, reverse=True) + (tl.cumsum(b_w, axis=0) - b_w)
    else:
        b_dq += b_dd * b_k
        b_dk += b_dki + b_dd * b_q
        b_dg = tl.cumsum(b_u, axis=0, reverse=True) + exclusive_cumsum(b_w, BT)
    b_dg += (tl.exp(b_gl) * b_hdh)[None, :]
    tl.store(DG + p_x, b_dg, mask=m_tk)
    if HAS_GV:
        tl.store(DQ + p_x, b_dq.to(DQ.dtype.element_ty), mask=m_tk)
        tl.store(DK_ + p_x, b_dk.to(DK_.dtype.element_ty), mask=m_tk)
