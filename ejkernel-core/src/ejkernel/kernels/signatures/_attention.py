"""Attention semantics that several contracts share, defined once for the public functions, the references
and every implementation: which keys a query admits (causal, sliding window, packed sequences; on positions
for the attention-block contract), the dropout hash, and the log-sum-exp merge of partial results.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def normalize_window(sliding_window: int | tuple[int, int] | None) -> tuple[int, int] | None:
    """``w`` -> ``(w, w)``; pairs pass through as tuples."""
    if sliding_window is None:
        return None
    if isinstance(sliding_window, int):
        return (sliding_window, sliding_window)
    return (int(sliding_window[0]), int(sliding_window[1]))


def attention_allowed(
    t: int,
    s: int,
    *,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    cu_seqlens_q: Any = None,
    cu_seqlens_k: Any = None,
) -> jax.Array:
    """The ``[T, S]`` boolean mask of the causal/window/packing rules of step 4 (True = may attend).

    The one definition of those rules: the reference and the dense implementations build their masks with it.

    >>> attention_allowed(2, 3, causal=True).astype(int).tolist()
    [[1, 1, 0], [1, 1, 1]]
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
        allowed &= j <= i + offset
    window = normalize_window(sliding_window)
    if window is not None:
        left, right = window
        allowed &= (j >= i + offset - left) & (j <= i + offset + right)
    return allowed


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
