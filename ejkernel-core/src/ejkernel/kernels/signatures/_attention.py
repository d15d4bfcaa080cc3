"""Attention semantics that several contracts share, defined once for the public functions, the references
and every implementation: which keys a query admits (causal, sliding window, packed sequences; on positions
for the attention-block contract), the dropout hash, and the log-sum-exp merge of partial results.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.kernels.signatures._checks import shape

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def normalize_window(sliding_window: int | tuple[int, int] | None) -> tuple[int, int] | None:
    """``w`` -> ``(w, w)``; pairs pass through as tuples."""
    if sliding_window is None:
        return None
    if isinstance(sliding_window, int):
        return (sliding_window, sliding_window)
    return (int(sliding_window[0]), int(sliding_window[1]))


def rows_broadcast(x: Any, query: Any, key: Any) -> Any:
    """``x`` ``[B|1, H|1, 1, S]`` broadcast over the query rows to ``[B|1, H|1, T, S]``; anything else as given
    (a wrong shape is reported by ``validate`` as the caller passed it)."""
    got, q, k = (shape(a) if a is not None else () for a in (x, query, key))
    if len(got) != 4 or len(q) != 4 or len(k) != 4 or got[2] != 1 or q[1] == 1 or got[3] != k[1]:
        return x
    return jnp.broadcast_to(x, (*got[:2], q[1], got[3]))


def attention_allowed(
    t: int,
    s: int,
    *,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    cu_seqlens_q: Any = None,
    cu_seqlens_k: Any = None,
    kv_lengths: Any = None,
    prefix_lengths: Any = None,
) -> jax.Array:
    """The ``[T, S]`` boolean mask of the causal/window/packing/length rules of step 4 (True = may attend);
    ``[B, T, S]`` when per-sequence ``kv_lengths`` or ``prefix_lengths`` (``[B]`` each) are given.

    The one definition of those rules: the reference and the dense implementations build their masks with it.

    >>> attention_allowed(2, 3, causal=True).astype(int).tolist()
    [[1, 1, 0], [1, 1, 1]]
    >>> attention_allowed(3, 3, causal=True, prefix_lengths=jnp.array([2])).astype(int).tolist()  # prefix-LM
    [[[1, 1, 0], [1, 1, 0], [1, 1, 1]]]
    """
    i = jnp.arange(t)[:, None]
    j = jnp.arange(s)[None, :]
    allowed = jnp.ones((t, s), bool)
    if cu_seqlens_q is not None:
        # Sequence index of every row and column; positions are re-based to each sequence's start.
        seq_q = jnp.searchsorted(cu_seqlens_q, jnp.arange(t), side="right") - 1
        seq_k = jnp.searchsorted(cu_seqlens_k, jnp.arange(s), side="right") - 1
        n = cu_seqlens_q.shape[0] - 1
        allowed &= (seq_q[:, None] == seq_k[None, :]) & (seq_q[:, None] < n) & (seq_k[None, :] < n)
        seq_q_c = jnp.clip(seq_q, 0, n - 1)
        len_q = cu_seqlens_q[seq_q_c + 1] - cu_seqlens_q[seq_q_c]
        len_k = cu_seqlens_k[seq_q_c + 1] - cu_seqlens_k[seq_q_c]
        i = (i[:, 0] - cu_seqlens_q[seq_q_c])[:, None]
        j = j - cu_seqlens_k[seq_q_c][:, None]
        offset = (len_k - len_q)[:, None]
    else:
        offset = s - t
    if causal:
        seen = j <= i + offset
        if prefix_lengths is not None:  # the prefix is seen by every row
            seen = seen | (j < jnp.asarray(prefix_lengths)[:, None, None])
        allowed = allowed & seen
    window = normalize_window(sliding_window)
    if window is not None:
        left, right = window
        allowed = allowed & (j >= i + offset - left) & (j <= i + offset + right)
    if kv_lengths is not None:
        allowed = allowed & (j < jnp.asarray(kv_lengths)[:, None, None])
    return allowed


def mask_intervals(
    t: int,
    s: int,
    *,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    cu_seqlens_q: Any = None,
    cu_seqlens_k: Any = None,
    kv_lengths: Any = None,
    prefix_lengths: Any = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """:func:`attention_allowed` as intervals, which kernels turn into block skipping.

    Returns ``(row_lo, row_hi, col_lo, col_hi)``, int32: query ``i`` of sequence ``b`` admits the keys
    ``[row_lo[b, i], row_hi[b, i])``, and key ``j`` is admitted by the queries ``[col_lo[b, j], col_hi[b, j])``
    (``[B, T]`` and ``[B, S]`` with ``kv_lengths``/``prefix_lengths``, else ``[1, T]`` and ``[1, S]``, the same
    for every sequence). An empty row is ``(S, 0)``, an empty column ``(T, 0)``. Every rule is an interval
    along either axis (causal and its prefix ``[0, max(i + d + 1, prefix))``, the window, the packed sequence,
    the key length), so their intersection is exact.

    Within a sequence (the whole array without packing) whose rows and keys start at ``q0``/``k0`` and end
    at ``q1``/``k1``, alignment is bottom-right: ``d = k1 - q1``. Rows before ``cu_seqlens_q[0]`` pair with
    the keys before ``cu_seqlens_k[0]``, aligned like sequence 0; rows past ``cu_seqlens_q[N]`` admit nothing.

    >>> lo, hi, clo, chi = mask_intervals(3, 3, causal=True, kv_lengths=jnp.array([3, 1]))
    >>> lo.tolist(), hi.tolist()
    ([[0, 0, 0], [0, 0, 0]], [[1, 2, 3], [1, 1, 1]])
    >>> clo.tolist(), chi.tolist()  # sequence 1's keys 1, 2 are admitted by no query
    ([[0, 1, 2], [0, 3, 3]], [[3, 3, 3], [3, 0, 0]])
    """
    i = jnp.arange(t, dtype=jnp.int32)
    j = jnp.arange(s, dtype=jnp.int32)
    k0: Any
    k1: Any
    d_row: Any
    row_valid: Any
    q0: Any
    q1: Any
    d_col: Any
    col_valid: Any
    if cu_seqlens_q is None:
        k0, k1, d_row, row_valid = 0, s, s - t, True
        q0, q1, d_col, col_valid = 0, t, s - t, True
    else:
        cu_q = jnp.asarray(cu_seqlens_q, jnp.int32)
        cu_k = jnp.asarray(cu_seqlens_k, jnp.int32)
        n = cu_q.shape[0] - 1
        seq = jnp.searchsorted(cu_q, i, side="right").astype(jnp.int32) - 1
        c = jnp.clip(seq, 0, n - 1)
        k0 = jnp.where(seq < 0, 0, cu_k[c])
        k1 = jnp.where(seq < 0, cu_k[0], cu_k[c + 1])
        d_row = cu_k[c + 1] - cu_q[c + 1]
        row_valid = seq < n
        seq = jnp.searchsorted(cu_k, j, side="right").astype(jnp.int32) - 1
        c = jnp.clip(seq, 0, n - 1)
        q0 = jnp.where(seq < 0, 0, cu_q[c])
        q1 = jnp.where(seq < 0, cu_q[0], cu_q[c + 1])
        d_col = cu_k[c + 1] - cu_q[c + 1]
        col_valid = seq < n
    per_batch = [jnp.asarray(x, jnp.int32) for x in (kv_lengths, prefix_lengths) if x is not None]
    nb = per_batch[0].shape[0] if per_batch else 1
    row_lo = jnp.broadcast_to(jnp.asarray(k0, jnp.int32), (nb, t))
    row_hi = jnp.broadcast_to(jnp.asarray(k1, jnp.int32), (nb, t))
    col_lo = jnp.broadcast_to(jnp.asarray(q0, jnp.int32), (nb, s))
    col_hi = jnp.broadcast_to(jnp.asarray(q1, jnp.int32), (nb, s))
    col_valid = jnp.broadcast_to(jnp.asarray(col_valid), (nb, s))
    # Lengths and windows are clipped to [0, T + S + 1]: beyond, they bound nothing (and int32 cannot overflow).
    big = t + s + 1
    if causal:
        last = i + d_row + 1
        first = j - d_col
        if prefix_lengths is not None:
            prefix = jnp.clip(jnp.asarray(prefix_lengths, jnp.int32), 0, big)[:, None]
            last = jnp.maximum(last, prefix)
            first = jnp.where(j < prefix, -big, first)
        row_hi = jnp.minimum(row_hi, last)
        col_lo = jnp.maximum(col_lo, first)
    window = normalize_window(sliding_window)
    if window is not None:
        left, right = (min(w, big) for w in window)
        row_lo = jnp.maximum(row_lo, i + d_row - left)
        row_hi = jnp.minimum(row_hi, i + d_row + right + 1)
        col_lo = jnp.maximum(col_lo, j - d_col - right)
        col_hi = jnp.minimum(col_hi, j - d_col + left + 1)
    if kv_lengths is not None:
        length = jnp.clip(jnp.asarray(kv_lengths, jnp.int32), 0, big)[:, None]
        row_hi = jnp.minimum(row_hi, length)
        col_valid = col_valid & (j < length)
    row_empty = (row_lo >= row_hi) | ~jnp.asarray(row_valid)
    col_empty = (col_lo >= col_hi) | ~col_valid
    row_lo = jnp.where(row_empty, s, jnp.clip(row_lo, 0, s)).astype(jnp.int32)
    row_hi = jnp.where(row_empty, 0, jnp.clip(row_hi, 0, s)).astype(jnp.int32)
    col_lo = jnp.where(col_empty, t, jnp.clip(col_lo, 0, t)).astype(jnp.int32)
    col_hi = jnp.where(col_empty, 0, jnp.clip(col_hi, 0, t)).astype(jnp.int32)
    return row_lo, row_hi, col_lo, col_hi


def mix32(x: Any, xp: Any = np) -> Any:
    """A 32-bit integer hash (lowbias32): cheap in every kernel language, good enough for dropout masks."""
    x = x.astype(xp.uint32)
    with np.errstate(over="ignore"):  # uint32 products wrap by design (numpy warns on scalars)
        x = x ^ (x >> 16)
        x = x * xp.uint32(0x7FEB352D)
        x = x ^ (x >> 15)
        x = x * xp.uint32(0x846CA68B)
        return x ^ (x >> 16)


def seed_from_query(query: Any) -> Any:
    """The dropout seed of a call that sets ``dropout_prob`` without ``dropout_seed``: a hash of every bit of
    ``query`` (and of where it sits), as an int32 scalar. Any change of the query changes the mask; the
    forward, the backward and a rematerialised forward all see the same query, hence the same mask.
    """
    x = jax.lax.stop_gradient(query).astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
    position = jnp.arange(bits.shape[0], dtype=jnp.uint32) * jnp.uint32(0x9E3779B9)
    h = jnp.sum(mix32(bits ^ position, jnp), dtype=jnp.uint32)  # wraps modulo 2**32
    return jax.lax.bitcast_convert_type(mix32(h, jnp), jnp.int32)


def dropout_keep(seed: Any, b: Any, h: Any, i: Any, j: Any, num_heads: int, p: float, xp: Any = np) -> Any:
    """Whether score ``(b, h, i, j)`` survives dropout with probability ``p`` of dropping, for ``seed``.

    ``row = mix32(mix32(seed ^ (b * H + h)) ^ i)``, ``keep = mix32(row ^ j) >= p * 2**32``; all in uint32.
    ``xp`` is ``numpy`` or ``jax.numpy``; arguments broadcast. An int seed counts modulo ``2**32``.
    """
    u32 = xp.uint32
    if isinstance(seed, int | np.integer):
        seed = np.uint32(int(seed) % 2**32)  # a Python int seed is taken modulo 2**32, like an array seed's bits
    bh = xp.asarray(b).astype(u32) * u32(num_heads) + xp.asarray(h).astype(u32)
    row = mix32(mix32(xp.asarray(seed).astype(u32) ^ bh, xp) ^ xp.asarray(i).astype(u32), xp)
    threshold = min(int(p * 2**32), 2**32 - 1)
    return mix32(row ^ xp.asarray(j).astype(u32), xp) >= u32(threshold)


# ---- the attention-block contract: which keys a row admits, merging partial results --------------------


def default_positions(t: int, s: int) -> tuple[jax.Array, jax.Array]:
    """``(q_positions, kv_positions)`` of a block without positions: ``flash_attention``'s bottom-right alignment."""
    return jnp.arange(t, dtype=jnp.int32) + (s - t), jnp.arange(s, dtype=jnp.int32)


def _shift(x: jax.Array, by: int) -> jax.Array:
    """``x + by`` in int32, saturating at the int32 range (a window wider than every position is unbounded)."""
    by = max(INT32_MIN, min(INT32_MAX, int(by)))
    if by >= 0:
        return jnp.where(x > INT32_MAX - by, INT32_MAX, x + by)
    return jnp.where(x < INT32_MIN - by, INT32_MIN, x + by)


def key_intervals(
    q_positions: jax.Array | None,
    kv_positions: jax.Array | None,
    t: int,
    s: int,
    *,
    causal: bool,
    window: tuple[int, int] | None,
) -> tuple[jax.Array, jax.Array]:
    """Per query ``i``, the keys ``[lo[i], hi[i])`` that causal/window masking admits (int32 ``[T]`` each).

    A row that admits none gets ``(S, 0)``. Segment ids are per element and not part of it.

    >>> lo, hi = key_intervals(jnp.array([2, 3]), jnp.array([0, 1, 2, 3]), 2, 4, causal=True, window=(1, 0))
    >>> lo.tolist(), hi.tolist()
    ([1, 2], [3, 4])
    """
    if not causal and window is None:
        return jnp.zeros((t,), jnp.int32), jnp.full((t,), s, jnp.int32)
    if q_positions is None:
        q_positions, kv_positions = default_positions(t, s)
    qpos, kpos = jnp.asarray(q_positions, jnp.int32), jnp.asarray(kv_positions, jnp.int32)
    lo = jnp.zeros((t,), jnp.int32)
    if window is not None:
        lo = jnp.searchsorted(kpos, _shift(qpos, -window[0]), side="left").astype(jnp.int32)
    last = qpos if causal else _shift(qpos, window[1])  # type: ignore[index]
    hi = jnp.searchsorted(kpos, last, side="right").astype(jnp.int32)
    empty = lo >= hi
    return jnp.where(empty, s, lo), jnp.where(empty, 0, hi)


def query_intervals(
    q_positions: jax.Array | None,
    kv_positions: jax.Array | None,
    t: int,
    s: int,
    *,
    causal: bool,
    window: tuple[int, int] | None,
) -> tuple[jax.Array, jax.Array]:
    """Per key ``j``, the queries ``[lo[j], hi[j])`` that admit it (int32 ``[S]`` each; ``(T, 0)`` when none).

    >>> lo, hi = query_intervals(jnp.array([2, 3]), jnp.array([0, 1, 2, 3]), 2, 4, causal=True, window=(1, 0))
    >>> lo.tolist(), hi.tolist()
    ([2, 0, 0, 1], [0, 1, 2, 2])
    """
    if not causal and window is None:
        return jnp.zeros((s,), jnp.int32), jnp.full((s,), t, jnp.int32)
    if q_positions is None:
        q_positions, kv_positions = default_positions(t, s)
    qpos, kpos = jnp.asarray(q_positions, jnp.int32), jnp.asarray(kv_positions, jnp.int32)
    first_q = kpos if causal else _shift(kpos, -window[1])  # type: ignore[index]
    lo = jnp.searchsorted(qpos, first_q, side="left").astype(jnp.int32)
    hi = jnp.full((s,), t, jnp.int32)
    if window is not None:
        hi = jnp.searchsorted(qpos, _shift(kpos, window[0]), side="right").astype(jnp.int32)
    empty = lo >= hi
    return jnp.where(empty, t, lo), jnp.where(empty, 0, hi)


def block_allowed(
    q_positions: jax.Array | None,
    kv_positions: jax.Array | None,
    t: int,
    s: int,
    *,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
) -> jax.Array:
    """The ``[T, S]`` boolean mask of the causal/window rules on positions (True = may attend): the dense form
    of :func:`key_intervals`, for references and tests."""
    if q_positions is None:
        q_positions, kv_positions = default_positions(t, s)
    qp = jnp.asarray(q_positions, jnp.int32)[:, None]
    kp = jnp.asarray(kv_positions, jnp.int32)[None, :]
    allowed = jnp.ones((t, s), bool)
    if causal:
        allowed &= kp <= qp
    window = normalize_window(sliding_window)
    if window is not None:
        allowed &= (kp >= _shift(qp, -window[0])) & (kp <= _shift(qp, window[1]))
    return allowed


def combine(out: jax.Array, lse: jax.Array, out_r: jax.Array, lse_r: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Two partial results ``(out [B, T, H, Dv], lse [B, H, T])`` over disjoint keys -> the result over both.

    Float32; a row that admits no key on either side stays ``(0, -inf)``.

    >>> o, l = combine(jnp.ones((1, 1, 1, 1)), jnp.zeros((1, 1, 1)), jnp.zeros((1, 1, 1, 1)), jnp.zeros((1, 1, 1)))
    >>> float(o[0, 0, 0, 0]), round(float(l[0, 0, 0]), 4)  # equal weights: the mean; lse = log 2
    (0.5, 0.6931)
    """
    new = jnp.logaddexp(lse, lse_r)
    ref = jnp.where(jnp.isfinite(new), new, 0.0)  # no key on either side: both weights are exp(-inf) = 0
    a = jnp.exp(lse - ref).transpose(0, 2, 1)[..., None]  # [B, T, H, 1]
    b = jnp.exp(lse_r - ref).transpose(0, 2, 1)[..., None]
    return out.astype(jnp.float32) * a + out_r.astype(jnp.float32) * b, new
