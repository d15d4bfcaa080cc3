"""Triton kernels of the grouped matmul: ``gmm`` (the forward and ``d lhs``) and ``tgmm`` (``d rhs``).

Shapes: M rows, G groups; ``gmm`` contracts KC and writes NO columns (the forward: KC = K, NO = N;
``d lhs``: KC = N, NO = K), ``tgmm`` writes ``[G, P, Q]`` (P, Q = K, N, or N, K for ``transpose_rhs``).

``gmm``: ``C[i] = A[i] @ B[g(i)]``, ``A [M, KC]`` and ``C [M, NO]`` row-major, ``B[g]`` a ``[KC, NO]`` matrix
read through the strides ``STRIDE_BG/BC/BO`` (group, contracted, output): ``rhs``, its transpose and the
transposed-rhs layout are one kernel, the operand loaded the way it lies in memory (no ``tl.trans``).
Its grid is a list of *work items* built on the device from ``group_sizes`` (``interface._schedule``): an
item is the part ``[lo, hi)`` of one row tile that lies in one segment, a group (``group >= 0``) or the
rows past ``sum(group_sizes)`` (``group = -1``: the item writes zeros, with no matmul). A row tile that
straddles a boundary is one item per segment it meets, each storing only its own rows, so every row of C
is written exactly once and no two programs write the same element. The static bound on the items is
``cdiv(M, BM) + G``; the items past the real ones have ``lo = hi`` and return at once. Programs map to
(item, column tile) in groups of ``GROUP_M`` items (the items of one group are consecutive row tiles), so
the programs that run together share the column tiles of ``B[g]`` in L2.

``tgmm``: ``D[g] = X[rows of g]^T @ Y[rows of g]``, ``X [M, P]``, ``Y [M, Q]``, one program per (group,
P tile, Q tile), looping over the group's rows (a loop of data-dependent length: an empty group stores
zeros). X is loaded as ``[BP, BM]`` tiles straight from its row-major layout.

Accumulation is float32; ``lhs``/``rhs`` rows and columns past the array are masked or clamped, so no
kernel reads outside its arrays. Names: ``b_`` a tile in registers, ``p_`` a tile of pointers.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ejkernel_triton.language import mma  # imports ejkernel_triton.launch first: the interpreter switch


@triton.jit
def _swizzle(pid, num_rows, NUM_COLS: tl.constexpr, GROUP: tl.constexpr):
    """(row, column) of program ``pid`` over a ``num_rows x NUM_COLS`` grid of tiles, ``GROUP`` rows at a time
    (column-major within a band of ``GROUP`` rows): consecutive programs share column tiles."""
    width = GROUP * NUM_COLS
    first = (pid // width) * GROUP
    size = tl.minimum(num_rows - first, GROUP)
    i_row = first + (pid % width) % size
    i_col = (pid % width) // size
    return i_row, i_col


@triton.jit
def _gmm_kernel(
    A,
    B,
    ItemGroup,
    ItemLo,
    ItemHi,
    M,
    num_items,
    C,
    KC: tl.constexpr,
    NO: tl.constexpr,
    STRIDE_BG: tl.constexpr,
    STRIDE_BC: tl.constexpr,
    STRIDE_BO: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    i_item, i_n = _swizzle(tl.program_id(0), num_items, tl.cdiv(NO, BLOCK_N), GROUP_M)
    lo = tl.load(ItemLo + i_item)
    hi = tl.load(ItemHi + i_item)
    if lo < hi:
        g = tl.load(ItemGroup + i_item)
        rows = (lo // BLOCK_M) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if g >= 0:
            # rows past M (the last tile) read row M - 1 and columns past NO column NO - 1: never stored
            rows_a = tl.minimum(rows, M - 1)
            if NO % BLOCK_N == 0:
                cols_b = cols
            else:
                cols_b = tl.minimum(cols, NO - 1)
            ks = tl.arange(0, BLOCK_K)
            p_a = A + rows_a.to(tl.int64)[:, None] * KC + ks[None, :]  # [BM, BK]
            p_b = B + g.to(tl.int64) * STRIDE_BG + ks[:, None] * STRIDE_BC + cols_b[None, :] * STRIDE_BO  # [BK, BN]
            for i_k in range(tl.cdiv(KC, BLOCK_K)):
                if KC % BLOCK_K == 0:
                    b_a = tl.load(p_a)
                    b_b = tl.load(p_b)
                else:
                    k_ok = ks < KC - i_k * BLOCK_K
                    b_a = tl.load(p_a, mask=k_ok[None, :], other=0.0)
                    b_b = tl.load(p_b, mask=k_ok[:, None], other=0.0)
                acc = mma(b_a, b_b, acc)
                p_a += BLOCK_K
                p_b += BLOCK_K * STRIDE_BC
        p_c = C + rows.to(tl.int64)[:, None] * NO + cols[None, :]
        ok = ((rows >= lo) & (rows < hi))[:, None] & (cols < NO)[None, :]
        tl.store(p_c, acc.to(p_c.dtype.element_ty), mask=ok)


@triton.jit
def _tgmm_kernel(
    X,
    Y,
    Starts,
    Ends,
    D,
    P: tl.constexpr,
    Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_p: tl.constexpr = (P + BLOCK_P - 1) // BLOCK_P
    tiles_q: tl.constexpr = (Q + BLOCK_Q - 1) // BLOCK_Q
    g = pid // (tiles_p * tiles_q)
    i_p = (pid % (tiles_p * tiles_q)) // tiles_q
    i_q = pid % tiles_q
    start = tl.load(Starts + g)
    end = tl.load(Ends + g)
    ps = i_p * BLOCK_P + tl.arange(0, BLOCK_P)
    qs = i_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    if P % BLOCK_P == 0:
        ps_x = ps
    else:
        ps_x = tl.minimum(ps, P - 1)
    if Q % BLOCK_Q == 0:
        qs_y = qs
    else:
        qs_y = tl.minimum(qs, Q - 1)
    acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        ok = rows < end  # the group's own rows: the next group's and rows past M read as 0
        b_xt = tl.load(X + rows.to(tl.int64)[None, :] * P + ps_x[:, None], mask=ok[None, :], other=0.0)  # [BP, BM]
        b_y = tl.load(Y + rows.to(tl.int64)[:, None] * Q + qs_y[None, :], mask=ok[:, None], other=0.0)  # [BM, BQ]
        acc = mma(b_xt, b_y, acc)
    p_d = D + g.to(tl.int64) * (P * Q) + ps[:, None] * Q + qs[None, :]
    tl.store(p_d, acc.to(p_d.dtype.element_ty), mask=(ps < P)[:, None] & (qs < Q)[None, :])
