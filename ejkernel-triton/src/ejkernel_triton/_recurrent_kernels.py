"""The fused recurrent kernel of ``gla`` and ``gated_delta_rule`` (decoding: a few tokens per sequence).

One program per (sequence, value head, block of ``BV`` value channels) holds its ``[K, BV]`` tile of the
float32 state in registers: it reads the tile once (the initial state, or zeros), walks the sequence's tokens
one by one, writes each token's output, and writes the tile once at the end (the final state). Nothing but
the state tile is carried between tokens, so the state never goes through memory in between.

Per token (``q``, ``k`` of the value head's query/key head ``hv // (HV // H)``, read in place: no repeat):

* ``gla`` (``DELTA`` off): ``S = diag(exp(g)) S + k^T v``, ``o = scale * q S``, ``g [K]`` per value head
  (``GATE_K``), or one ``g`` per token and head (``lightning_attn``, ``recurrent`` without a key gate: ``S = exp(g)
  S``); with ``GATE_V`` (``recurrent``'s value gate) also ``S = S diag(exp(g_v))`` before adding ``k^T v``,
  ``g_v [V]``;
* ``gated_delta_rule`` (``DELTA`` on): with ``L2NORM`` ``q``, ``k`` divided by ``sqrt(|x|^2 + 1e-6)``;
  ``S = exp(g) S``; ``S += k (beta (v - S^T k))^T``; ``o = scale * S^T q``, ``g`` and ``beta`` scalars.

Layouts (C-contiguous, as the ops take them; ``R = B * T`` rows of tokens):

* ``q``, ``k [R, H, DK]``; ``v [R, HV, DV]``; gates ``g [R, HV, DK]`` (``GATE_K``) or ``[R, HV]``, ``g_v [R, HV, DV]``,
  ``beta [R, HV]``;
* ``h0``, ``ht [N, HV, DK, DV]`` float32 (``N = B``, or the packed sequences);
* ``cu [N + 1]`` int32 (``VARLEN``: sequence ``n`` is rows ``[cu[n], cu[n + 1])``, already clamped into
  ``[0, T]``; else sequence ``n`` is rows ``[n T, (n + 1) T)``);
* ``o [R, HV, DV]`` in its own dtype (the launcher zero-fills it for ``VARLEN``: rows outside every sequence).

Head-dim padding (``DK < BK``, ``DV`` not a multiple of ``BV``) reads as 0 and is never stored; a padded key
channel keeps a zero state row (its gate reads 0: ``exp(0) * 0``), a padded value channel a zero column. Every
computation is in float32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ejkernel_triton import launch as _launch  # noqa: F401  (the interpreter switch, before any @triton.jit)


@triton.jit
def fused_recurrent_fwd(
    Q,
    K,
    V,
    G,
    GV,
    Beta,
    H0,
    Cu,
    scale,
    T,
    O,
    HT,
    H: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DELTA: tl.constexpr,
    GATE_K: tl.constexpr,
    GATE_V: tl.constexpr,
    L2NORM: tl.constexpr,
    HAS_H0: tl.constexpr,
    STORE_FINAL: tl.constexpr,
    VARLEN: tl.constexpr,
):
    i_nh = tl.program_id(0)  # (sequence, value head): the long axis, where CUDA allows 2^31 - 1 programs
    i_v = tl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)  # the query/key head this value head reads
    if VARLEN:
        bos = tl.load(Cu + i_n).to(tl.int64)
        eos = tl.load(Cu + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < DK
    m_v = o_v < DV
    m_h = m_k[:, None] & m_v[None, :]
    p_state = (i_n.to(tl.int64) * HV + i_hv) * (DK * DV) + o_k[:, None] * DV + o_v[None, :]

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        b_h += tl.load(H0 + p_state, mask=m_h, other=0.0).to(tl.float32)

    for i in range(eos - bos):
        row = bos + i  # int64
        p_qk = (row * H + i_h) * DK + o_k
        b_q = tl.load(Q + p_qk, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(K + p_qk, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(V + (row * HV + i_hv) * DV + o_v, mask=m_v, other=0.0).to(tl.float32)
        if DELTA and L2NORM:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, 0) + 1e-6)
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, 0) + 1e-6)
        if GATE_K:  # a log decay per key channel
            b_g = tl.load(G + (row * HV + i_hv) * DK + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_h = b_h * tl.exp(b_g)[:, None]
        else:  # one per token and head
            b_h = b_h * tl.exp(tl.load(G + row * HV + i_hv).to(tl.float32))
        if GATE_V:
            b_gv = tl.load(GV + (row * HV + i_hv) * DV + o_v, mask=m_v, other=0.0).to(tl.float32)
            b_h = b_h * tl.exp(b_gv)[None, :]
        if DELTA:  # what the state holds for k, moved a fraction beta towards v
            b_beta = tl.load(Beta + row * HV + i_hv).to(tl.float32)
            b_v = b_beta * (b_v - tl.sum(b_h * b_k[:, None], 0))
        b_h += b_k[:, None] * b_v[None, :]
        b_o = tl.sum(b_h * b_q[:, None], 0) * scale
        tl.store(O + (row * HV + i_hv) * DV + o_v, b_o.to(O.dtype.element_ty), mask=m_v)

    if STORE_FINAL:
        tl.store(HT + p_state, b_h, mask=m_h)
