"""The attention-block contract: ``flash_attention_block`` (forward) and ``flash_attention_block_bwd`` (backward).

The FlashAttention-2 pieces a chunked schedule (a ring, a split of the keys) is written in: the attention of
a block of queries against *one* block of keys/values, as a partial result ``(out, lse)`` that partial
results over other key blocks merge with by log-sum-exp (:func:`combine`), and a backward per block that takes
the *global* ``out``/``lse`` of the rows (over every key block), so that each block's gradients are
independent and simply add up. A schedule calls both through the core's dispatch, so the fastest installed
implementation of each runs (each op has its own config chain).

Shapes: B batch, T queries of the block, S keys of the block, H query heads, K key/value heads (H % K == 0;
query head h reads kv head h // (H // K)), D query/key head dim, Dv value head dim.

Which keys a query admits. Every query and key has a *position* (int32): ``q_positions [T]`` and
``kv_positions [S]``, both **non-decreasing** (checked when concrete; implementations rely on it: the keys
a row admits are one interval). Without them (both None) the positions are those of ``flash_attention``:
``q_positions[i] = i + S - T`` and ``kv_positions[j] = j`` (bottom-right aligned). Key j is admitted by
query i unless masked by

- ``causal``: ``kv_positions[j] <= q_positions[i]``;
- ``sliding_window=(left, right)`` (an int ``w`` means ``(w, w)``):
  ``q_positions[i] - left <= kv_positions[j] <= q_positions[i] + right``;
- segment ids (when given, both): ``q_segment_ids[b, i] == kv_segment_ids[b, j]``.

The positions only matter with ``causal`` or ``sliding_window`` (pass None otherwise). A schedule gives
global positions, e.g. a ring step over the shard of device ``src``: the layout's global positions of the
local queries (shifted by ``n*S - n*T`` for the bottom-right alignment) and of the visiting keys.

Forward, per row: ``s = softmax_scale * q_i . k_j`` (default scale ``D ** -0.5``), ``s = logits_soft_cap *
tanh(s / logits_soft_cap)``, masking, softmax over the admitted keys in float32. Returns

- ``out [B, T, H, Dv]`` **float32** (whatever the input dtype: partial results are merged in float32 and
  the schedule rounds once, at the end); zeros on a row that admits no key of the block;
- ``lse [B, H, T]`` float32: the natural log of the softmax denominator, ``-inf`` on a row that admits no key.

Backward: given the row's **global** ``out`` (any float dtype) and ``lse`` (float32, ``-inf`` where the row
admits no key anywhere) and the cotangent ``dout`` of ``out``, with ``P = exp(s - lse)`` on this block's
admitted keys and ``delta = rowsum(dout * out)`` (minus ``dlse`` when the log-sum-exp is differentiated too:
``dS = P * (dP - delta + dlse)``), it returns this block's share of the gradients, **float32**:
``dq [B, T, H, D]``, ``dk [B, S, K, D]``, ``dv [B, S, K, Dv]`` (dk/dv summed over the query heads of each
kv head). Summing ``dq`` over every key block (and taking each block's ``dk``/``dv``) gives the gradients of
the whole attention.

The launch parameters of ``flash_attention_block_bwd`` are its backward kernel's: it is an op of its own,
so an implementation takes them as its ``fwd_params`` (stage ``fwd`` of that op; the XLA and Triton
implementations register ``BwdParams`` as that class).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ejkernel.kernels.params import BwdParams, FwdParams
from ejkernel.kernels.signatures._checks import (
    check_bool,
    check_query_key_value,
    check_scale,
    check_segment_ids,
    check_soft_cap,
    check_values,
    check_window,
    describe,
    first,
    is_int_array,
    shape,
)

OP = "flash_attention_block"
OP_BWD = "flash_attention_block_bwd"
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def flash_attention_block(
    query: Float[Array, "B T H D"],
    key: Float[Array, "B S K D"],
    value: Float[Array, "B S K Dv"],
    *,
    q_positions: Int[Array, "T"] | None = None,
    kv_positions: Int[Array, "S"] | None = None,
    q_segment_ids: Int[Array, "B T"] | None = None,
    kv_segment_ids: Int[Array, "B S"] | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    fwd_params: FwdParams | None = None,
    bwd_params: BwdParams | None = None,
) -> tuple[Float[Array, "B T H Dv"], Float[Array, "B H T"]]:
    """Canonical signature of ``flash_attention_block``: ``(out float32, lse float32)`` (see the module docstring)."""
    raise NotImplementedError


def flash_attention_block_bwd(
    query: Float[Array, "B T H D"],
    key: Float[Array, "B S K D"],
    value: Float[Array, "B S K Dv"],
    out: Float[Array, "B T H Dv"],
    lse: Float[Array, "B H T"],
    dout: Float[Array, "B T H Dv"],
    *,
    dlse: Float[Array, "B H T"] | None = None,
    q_positions: Int[Array, "T"] | None = None,
    kv_positions: Int[Array, "S"] | None = None,
    q_segment_ids: Int[Array, "B T"] | None = None,
    kv_segment_ids: Int[Array, "B S"] | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    fwd_params: BwdParams | None = None,
    bwd_params: BwdParams | None = None,
) -> tuple[Float[Array, "B T H D"], Float[Array, "B S K D"], Float[Array, "B S K Dv"]]:
    """Canonical signature of ``flash_attention_block_bwd``: ``(dq, dk, dv)`` float32 (see the module docstring)."""
    raise NotImplementedError


# ---- which keys a row admits -----------------------------------------------------------------------


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
    from ejkernel.kernels.signatures.flash_attention import normalize_window

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


# ---- validation ------------------------------------------------------------------------------------


def _check_positions(op: str, q_positions: Any, kv_positions: Any, t: int, s: int) -> None:
    if (q_positions is None) != (kv_positions is None):
        raise ValueError(f"{op}: pass both q_positions and kv_positions, or neither")
    if q_positions is None:
        return
    for name, x, n in (("q_positions", q_positions, t), ("kv_positions", kv_positions, s)):
        if shape(x) != (n,) or not is_int_array(x):
            raise ValueError(f"{op}: {name} must be an integer array of shape [{n}], got {describe(x)}")

        def sorted_(p: np.ndarray, name: str = name) -> None:
            at = first(np.diff(np.asarray(p).astype(np.int64)) < 0)
            if at is not None:
                i = at[0] + 1
                raise ValueError(
                    f"{op}: {name} must be non-decreasing, got {name}[{i}] = {p[i]} after {name}[{i - 1}] = {p[i - 1]}"
                )

        check_values(sorted_, x)


def _check_options(op: str, softmax_scale: Any, causal: Any, sliding_window: Any, logits_soft_cap: Any) -> None:
    check_scale(op, "softmax_scale", softmax_scale)
    check_bool(op, "causal", causal)
    check_window(op, "sliding_window", sliding_window)
    check_soft_cap(op, logits_soft_cap)


def validate(
    query: Any,
    key: Any,
    value: Any,
    *,
    q_positions: Any = None,
    kv_positions: Any = None,
    q_segment_ids: Any = None,
    kv_segment_ids: Any = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    **_: Any,
) -> None:
    """Check a ``flash_attention_block`` call; raise an error naming the argument, what was expected and what came."""
    q, k = check_query_key_value(OP, query, key, value)
    b, t, s = q[0], q[1], k[1]
    _check_positions(OP, q_positions, kv_positions, t, s)
    check_segment_ids(OP, q_segment_ids, kv_segment_ids, b, t, s)
    _check_options(OP, softmax_scale, causal, sliding_window, logits_soft_cap)


def validate_bwd(
    query: Any,
    key: Any,
    value: Any,
    out: Any,
    lse: Any,
    dout: Any,
    *,
    dlse: Any = None,
    q_positions: Any = None,
    kv_positions: Any = None,
    q_segment_ids: Any = None,
    kv_segment_ids: Any = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    **_: Any,
) -> None:
    """Check a ``flash_attention_block_bwd`` call (the forward's checks, plus ``out``, ``lse``, ``dout``, ``dlse``)."""
    q, k = check_query_key_value(OP_BWD, query, key, value)
    b, t, h, s, dv = q[0], q[1], q[2], k[1], shape(value)[-1]
    for name, x, want in (("out", out, (b, t, h, dv)), ("dout", dout, (b, t, h, dv)), ("lse", lse, (b, h, t))):
        if shape(x) != want or not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{OP_BWD}: {name} must be a float array of shape {list(want)}, got {describe(x)}")
    if dlse is not None and (shape(dlse) != (b, h, t) or not jnp.issubdtype(dlse.dtype, jnp.floating)):
        raise ValueError(f"{OP_BWD}: dlse must be a float array of shape {[b, h, t]}, got {describe(dlse)}")
    _check_positions(OP_BWD, q_positions, kv_positions, t, s)
    check_segment_ids(OP_BWD, q_segment_ids, kv_segment_ids, b, t, s)
    _check_options(OP_BWD, softmax_scale, causal, sliding_window, logits_soft_cap)
