"""Triton device helpers the ejkernel-triton kernels share (``@triton.jit``, inlined where called).

Import names from here into a kernel module (``from ejkernel_triton.language import load_tile, mma``)
rather than copying them. Importing this module imports Triton and, first, ``ejkernel_triton.launch``,
whose interpreter switch must precede every ``@triton.jit`` (see its docstring).

* dots: :func:`mma` (float32 accumulation; exact float32; runs in the interpreter too);
* math: :func:`tanh`, :data:`LOG2E`, :data:`LN2`, :func:`online_softmax_step` (softmax in log2 units);
* tiles of row-major arrays: :func:`load_tile`, :func:`store_tile`;
* bases of the attention layouts: :func:`head_base` (``[B, L, NH, DH]``), :func:`stats_base`
  (``[B, H, T]``), :func:`bcast_base` (broadcast ``[NB, NH, T, S]``);
* intervals (which keys a query admits, or queries a key): :func:`bounds`, :func:`block_range`,
  :func:`span` -- visit a block's range as masked | unmasked | masked parts;
* dropout as the attention contracts define it (``ejkernel.kernels.signatures._attention.dropout_keep``):
  :func:`mix32`, :func:`dropout_head_hash`, :func:`dropout_row_hash`, :func:`dropout_keep`,
  :func:`dropout_keep_mask`.

Names follow the fla convention: ``b_x`` a tile in registers, ``p_x`` a tile of pointers.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ejkernel_triton import launch as _launch  # must run before any @triton.jit below (interpreter switch)

__all__ = [
    "LN2",
    "LOG2E",
    "bcast_base",
    "block_range",
    "bounds",
    "dropout_head_hash",
    "dropout_keep",
    "dropout_keep_mask",
    "dropout_row_hash",
    "head_base",
    "load_tile",
    "mix32",
    "mma",
    "online_softmax_step",
    "span",
    "stats_base",
    "store_tile",
    "tanh",
]

# Triton's interpreter (3.x) hands bfloat16 tiles to numpy's matmul as raw uint16 bit patterns, so
# in the interpreter bf16 operands are upcast to float32 before tl.dot (bf16 x bf16 products are
# exact in float32, so this reproduces a tensor-core dot with float32 accumulation). Never on GPU.
_UPCAST_BF16_DOT = tl.constexpr(_launch.INTERPRET)
# float32 inputs: full-precision (FMA) dots rather than tf32, so float32 results match a float32
# reference to ~1e-6 rather than ~1e-3. bf16/fp16 inputs always use tensor cores.
_F32_DOT_PRECISION = tl.constexpr("ieee")
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


# ------------------------------------------------------------------------------------------------
# Dots and math.
# ------------------------------------------------------------------------------------------------


@triton.jit
def mma(a, b, acc):
    """``acc + a @ b`` with float32 accumulation (see the notes on the two constants above)."""
    if _UPCAST_BF16_DOT:
        if a.dtype == tl.bfloat16:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
    if a.dtype == tl.float32:
        acc = tl.dot(a, b, acc, input_precision=_F32_DOT_PRECISION)
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def tanh(x):
    """tanh to a few float32 ulps, from exp (no libdevice, so the interpreter runs it too); saturates cleanly at
    +-1 and keeps NaN. ``(1 - e) / (1 + e)`` with ``e = exp(-2|x|)`` cancels for small ``|x|`` (a soft cap of
    1000 puts most scores there), so below 1/4 the odd Taylor series to ``x**9`` stands in (its next term is
    1e-8 of ``tanh`` there)."""
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    t = (1.0 - e) / (1.0 + e)
    x2 = x * x
    series = ax * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    t = tl.where(ax < 0.25, series, t)
    return tl.where(x < 0, -t, t)


@triton.jit
def online_softmax_step(b_s, m_i, l_i, acc):
    """One key block of an online softmax over scores ``b_s [BM, BN]`` in log2 units.

    ``m_i``/``l_i [BM]`` are the running row max and row sum, ``acc [BM, *]`` the running
    (unnormalized) output. Returns ``(b_p, m_new, l_i, acc)``: the block's probabilities relative to
    the new max, the new max, the sum updated with ``b_p``, and ``acc`` rescaled to the new max (the
    caller adds ``b_p @ V``). A row that has seen only ``-inf`` keeps 0 as its reference point, so
    ``exp2(-inf - m)`` is 0, never NaN."""
    m_new = tl.maximum(m_i, tl.max(b_s, 1))  # [BM]
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    b_p = tl.exp2(b_s - m_ref[:, None])  # [BM, BN]
    alpha = tl.exp2(m_i - m_ref)  # rescales the old sums
    l_i = l_i * alpha + tl.sum(b_p, 1)
    acc = acc * alpha[:, None]
    return b_p, m_new, l_i, acc


# ------------------------------------------------------------------------------------------------
# Tiles and bases.
# ------------------------------------------------------------------------------------------------


@triton.jit
def load_tile(base, rows, row_stride, n_rows, N_COLS: tl.constexpr, BLOCK_COLS: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """Tile ``[len(rows), BLOCK_COLS]`` of a row-major matrix; columns past ``N_COLS`` (head-dim
    padding to a power of two) and, when ``CHECK_ROWS``, rows past ``n_rows`` read as 0."""
    cols = tl.arange(0, BLOCK_COLS)
    p_x = base + rows.to(tl.int64)[:, None] * row_stride + cols[None, :]
    if CHECK_ROWS:
        if N_COLS == BLOCK_COLS:
            b_x = tl.load(p_x, mask=(rows < n_rows)[:, None], other=0.0)
        else:
            b_x = tl.load(p_x, mask=(rows < n_rows)[:, None] & (cols < N_COLS)[None, :], other=0.0)
    else:
        if N_COLS == BLOCK_COLS:
            b_x = tl.load(p_x)
        else:
            b_x = tl.load(p_x, mask=(cols < N_COLS)[None, :], other=0.0)
    return b_x


@triton.jit
def store_tile(base, b_x, rows, row_stride, n_rows, N_COLS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """Store ``b_x`` (cast to the array's dtype) where :func:`load_tile` would read, rows past ``n_rows``
    and columns past ``N_COLS`` left alone."""
    cols = tl.arange(0, BLOCK_COLS)
    p_x = base + rows.to(tl.int64)[:, None] * row_stride + cols[None, :]
    if N_COLS == BLOCK_COLS:
        tl.store(p_x, b_x.to(p_x.dtype.element_ty), mask=(rows < n_rows)[:, None])
    else:
        tl.store(p_x, b_x.to(p_x.dtype.element_ty), mask=(rows < n_rows)[:, None] & (cols < N_COLS)[None, :])


@triton.jit
def head_base(X, i_b64, i_h, L, NH: tl.constexpr, DH: tl.constexpr):
    """Start of head ``i_h`` of batch ``i_b64`` in a ``[B, L, NH, DH]`` array (rows ``NH * DH`` apart)."""
    return X + i_b64 * L * (NH * DH) + i_h * DH


@triton.jit
def stats_base(X, i_b64, i_h, T, H: tl.constexpr):
    """Start of row ``(b, h)`` of a ``[B, H, T]`` per-row statistic (``lse``, ``delta``)."""
    return X + (i_b64 * H + i_h) * T


@triton.jit
def bcast_base(X, i_b64, i_h, stride_b, stride_h):
    """Start of the ``[T, S]`` matrix of (batch, head) in a bias or mask (broadcast dims: stride 0)."""
    return X + i_b64 * stride_b + i_h.to(tl.int64) * stride_h


# ------------------------------------------------------------------------------------------------
# Intervals: row i admits columns [lo[i], hi[i]) (an empty one is lo = n_cols, hi = 0).
# ------------------------------------------------------------------------------------------------


@triton.jit
def bounds(Lo, Hi, idx, n, empty_lo):
    """Intervals ``[lo, hi)`` at ``idx`` (query rows or keys); past ``n`` the empty interval
    ``(empty_lo, 0)``, so that padding never widens a block's range and never attends."""
    ok = idx < n
    lo = tl.load(Lo + idx, mask=ok, other=empty_lo)
    hi = tl.load(Hi + idx, mask=ok, other=0)
    return lo, hi


@triton.jit
def block_range(lo, hi, BLOCK: tl.constexpr, ALL_MASKED: tl.constexpr):
    """Split the blocks one row block (or key block) must visit into masked | full | masked.

    ``lo``/``hi`` are the per-row intervals of the block. Visited: ``[start, end)`` with ``start``
    rounded down to a block boundary; blocks inside ``[full_lo, full_hi)`` are admitted whole by
    every row, so they need no mask (none are when ``ALL_MASKED``: per-element masks). All four are
    block-aligned except where clamped to ``end``.
    """
    start = (tl.min(lo, axis=0) // BLOCK) * BLOCK
    end = tl.max(hi, axis=0)
    if ALL_MASKED:
        full_lo = end
        full_hi = end
    else:
        full_lo = ((tl.max(lo, axis=0) + BLOCK - 1) // BLOCK) * BLOCK
        full_hi = (tl.min(hi, axis=0) // BLOCK) * BLOCK
    full_lo = tl.minimum(tl.maximum(full_lo, start), end)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), end)
    return start, full_lo, full_hi, end


@triton.jit
def span(PART: tl.constexpr, start, full_lo, full_hi, end):
    """Bounds of part ``PART`` of a visit split by :func:`block_range`: 0 the leading masked blocks,
    1 the interior that needs no mask, 2 the trailing masked blocks. Kernels run the three parts in
    this order (``tl.static_range(3)``, one loop each, masked unless ``PART == 1``)."""
    if PART == 0:
        b_lo = start
        b_hi = full_lo
    elif PART == 1:
        b_lo = full_lo
        b_hi = full_hi
    else:
        b_lo = full_hi
        b_hi = end
    return b_lo, b_hi


# ------------------------------------------------------------------------------------------------
# Dropout: element (b, h, i, j) survives iff mix32(mix32(mix32(seed ^ (b*H + h)) ^ i) ^ j) >= p * 2**32.
# ------------------------------------------------------------------------------------------------


@triton.jit
def mix32(x):
    """lowbias32, the uint32 hash of ``ejkernel.kernels.signatures._attention.mix32``.

    ``x`` is uint32: shifts are logical and products wrap mod 2**32, exactly like numpy's uint32."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def dropout_head_hash(Seed, i_b, i_h, H: tl.constexpr):
    """``mix32(seed ^ (b*H + h))``: the (batch, head) half of ``dropout_keep`` (once per head)."""
    return mix32(tl.load(Seed) ^ (i_b * H + i_h).to(tl.uint32))


@triton.jit
def dropout_row_hash(Seed, i_b, i_h, rows, H: tl.constexpr, DROP_THRESH: tl.constexpr):
    """``mix32(mix32(seed ^ (b*H + h)) ^ i)``: the per-row half of ``dropout_keep`` (once per row);
    ``rows`` itself, unused, without dropout (``DROP_THRESH == 0``)."""
    if DROP_THRESH > 0:
        b_hash = mix32(dropout_head_hash(Seed, i_b, i_h, H) ^ rows.to(tl.uint32))  # uint32
    else:
        b_hash = rows
    return b_hash


@triton.jit
def dropout_keep(b_hash, jj, DROP_THRESH: tl.constexpr):
    """Element half of ``dropout_keep``: ``mix32(row ^ j) >= p * 2**32`` for the row hashes ``b_hash``
    of :func:`dropout_row_hash`; broadcasts like its inputs."""
    return mix32(b_hash ^ jj.to(tl.uint32)) >= DROP_THRESH


@triton.jit
def dropout_keep_mask(b_hash, jj, DROP_THRESH: tl.constexpr):
    """Which elements dropout keeps (row hashes ``b_hash``/``jj`` broadcast to the tile); unused without dropout."""
    if DROP_THRESH > 0:
        keep = dropout_keep(b_hash, jj, DROP_THRESH)
    else:
        keep = jj  # unused
    return keep
