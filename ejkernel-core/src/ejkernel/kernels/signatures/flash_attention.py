"""The ``flash_attention`` contract.

Shapes: B batch, T query length, S key length, H query heads, K key/value heads (H % K == 0;
query head h reads kv head h // (H // K)), D query/key head dim, Dv value head dim, N packed sequences.

Semantics, in the order they apply to the scores of query i and key j:

1. ``s = softmax_scale * q_i . k_j`` (``softmax_scale`` defaults to ``D ** -0.5``);
2. ``s += bias`` (broadcast over batch and heads);
3. ``s = logits_soft_cap * tanh(s / logits_soft_cap)``;
4. the key is masked out unless every given mask admits it: ``attention_mask[b, h, i, j]``;
   equal segment ids; ``causal``: ``j <= i + S - T`` (bottom-right aligned, as FlashAttention 2);
   ``sliding_window=(left, right)``: ``i + S - T - left <= j <= i + S - T + right`` (an int ``w``
   means ``(w, w)``); with ``cu_seqlens_q``/``cu_seqlens_k`` (B == 1) the sequences are packed
   along T and S, keys attend only within their own sequence, and causal/window alignment is per
   sequence (``cu_seqlens_q`` non-decreasing within ``[0, T]``, ``cu_seqlens_k`` within ``[0, S]``: checked
   when concrete; under ``jit`` unchecked unless ``EJKERNEL_CHECKS=1``, and a violation gives a wrong
   output without an error);
5. softmax over the admitted keys in float32; a row with no admitted key gives zeros (never NaN);
6. dropout: probability ``p`` is dropped and survivors are scaled by ``1 / (1 - p)``; whether
   ``(b, h, i, j)`` survives is ``dropout_keep(seed, b, h, i, j, H, p)`` below, so every backend
   drops exactly the same entries and the forward and backward agree. Without ``dropout_seed`` the seed
   is :func:`seed_from_query`: a hash of the query's values, so the mask changes whenever the query
   does (every training step, every layer) and is the same for identical inputs;
7. ``out = P @ v`` in the dtype of ``query``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from ejkernel.kernels.params import BwdParams, FwdParams
from ejkernel.kernels.signatures._checks import (
    check_bool,
    check_cu_seqlens,
    check_float,
    check_query_key_value,
    check_scale,
    check_segment_ids,
    check_soft_cap,
    check_window,
    describe,
    dtype_name,
    is_int_array,
    shape,
)

OP = "flash_attention"


def flash_attention(
    query: Float[Array, "B T H D"],
    key: Float[Array, "B S K D"],
    value: Float[Array, "B S K Dv"],
    bias: Float[Array, "#B #H T S"] | None = None,
    *,
    attention_mask: Bool[Array, "#B #H T S"] | None = None,
    q_segment_ids: Int[Array, "B T"] | None = None,
    kv_segment_ids: Int[Array, "B S"] | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    dropout_prob: float = 0.0,
    dropout_seed: int | Int[Array, ""] | None = None,
    cu_seqlens_q: Int[Array, "N+1"] | None = None,
    cu_seqlens_k: Int[Array, "N+1"] | None = None,
    fwd_params: FwdParams | None = None,
    bwd_params: BwdParams | None = None,
) -> Float[Array, "B T H Dv"]:
    """Canonical signature of ``flash_attention`` (see the module docstring for the semantics)."""
    raise NotImplementedError


def _check_broadcastable(name: str, x: Any, full: tuple[int, int, int, int]) -> None:
    got = shape(x)
    if len(got) != 4 or any(g not in (1, f) for g, f in zip(got[:2], full[:2])) or got[2:] != full[2:]:
        raise ValueError(
            f"{OP}: {name} must have shape [B|1, H|1, T, S] = [{full[0]}|1, {full[1]}|1, {full[2]}, {full[3]}], "
            f"got {list(got)}"
        )


def validate(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    *,
    attention_mask: Any = None,
    q_segment_ids: Any = None,
    kv_segment_ids: Any = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    dropout_prob: float = 0.0,
    dropout_seed: Any = None,
    cu_seqlens_q: Any = None,
    cu_seqlens_k: Any = None,
    **_: Any,
) -> None:
    """Check a ``flash_attention`` call; raise an error naming the argument, what was expected and what came."""
    q, k = check_query_key_value(OP, query, key, value)
    b, t, h, s = q[0], q[1], q[2], k[1]
    if bias is not None:
        _check_broadcastable("bias", bias, (b, h, t, s))
        check_float(OP, "bias", bias)
    if attention_mask is not None:
        _check_broadcastable("attention_mask", attention_mask, (b, h, t, s))
        if dtype_name(attention_mask) != "bool":
            raise TypeError(f"{OP}: attention_mask must be bool (True = attend), got {dtype_name(attention_mask)}")
    check_segment_ids(OP, q_segment_ids, kv_segment_ids, b, t, s)
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError(f"{OP}: pass both cu_seqlens_q and cu_seqlens_k, or neither")
    if cu_seqlens_q is not None:
        if q_segment_ids is not None:
            raise ValueError(
                f"{OP}: cu_seqlens_q/cu_seqlens_k and q_segment_ids/kv_segment_ids both pack sequences; pass one"
            )
        n = check_cu_seqlens(OP, "cu_seqlens_q", cu_seqlens_q, b, t)
        if check_cu_seqlens(OP, "cu_seqlens_k", cu_seqlens_k, b, s, "S") != n:
            raise ValueError(
                f"{OP}: cu_seqlens_q and cu_seqlens_k must have the same length, "
                f"got {n + 1} and {shape(cu_seqlens_k)[0]}"
            )
    check_scale(OP, "softmax_scale", softmax_scale)
    check_bool(OP, "causal", causal)
    check_window(OP, "sliding_window", sliding_window)
    check_soft_cap(OP, logits_soft_cap)
    if not (isinstance(dropout_prob, int | float) and 0.0 <= dropout_prob < 1.0):
        raise ValueError(f"{OP}: dropout_prob must be a float in [0, 1), got {dropout_prob!r}")
    if (
        dropout_seed is not None
        and not isinstance(dropout_seed, int)
        and (shape(dropout_seed) != () or not is_int_array(dropout_seed))
    ):
        raise TypeError(f"{OP}: dropout_seed must be an int or a scalar integer array, got {describe(dropout_seed)}")


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
    import jax
    import jax.numpy as jnp

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
