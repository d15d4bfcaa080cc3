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
   sequence;
5. softmax over the admitted keys in float32; a row with no admitted key gives zeros (never NaN);
6. dropout: probability ``p`` is dropped and survivors are scaled by ``1 / (1 - p)``; whether
   ``(b, h, i, j)`` survives is ``dropout_keep(seed, b, h, i, j, H, p)`` below, so every backend
   drops exactly the same entries and the forward and backward agree;
7. ``out = P @ v`` in the dtype of ``query``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jaxtyping import Array, Bool, Float, Int

from ejkernel.kernels.params import BwdParams, FwdParams

_FLOAT_DTYPES = ("float32", "bfloat16", "float16")


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


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(np.shape(x))


def _dtype(x: Any) -> str:
    return str(np.dtype(x.dtype)) if hasattr(x, "dtype") else type(x).__name__


def _is_int(x: Any) -> bool:
    return np.issubdtype(np.dtype(x.dtype), np.integer)


def _broadcastable(name: str, x: Any, full: tuple[int, int, int, int]) -> None:
    shape = _shape(x)
    if len(shape) != 4 or any(s not in (1, f) for s, f in zip(shape[:2], full[:2])) or shape[2:] != full[2:]:
        raise ValueError(
            f"flash_attention: {name} must have shape [B|1, H|1, T, S] = [{full[0]}|1, {full[1]}|1, {full[2]}, {full[3]}], "
            f"got {list(shape)}"
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
    for name, x in (("query", query), ("key", key), ("value", value)):
        if len(_shape(x)) != 4:
            layout = {"query": "[B, T, H, D]", "key": "[B, S, K, D]", "value": "[B, S, K, Dv]"}[name]
            raise ValueError(f"flash_attention: {name} must be 4-D {layout}, got shape {list(_shape(x))}")
        if _dtype(x) not in _FLOAT_DTYPES:
            raise TypeError(f"flash_attention: {name} must be float32, bfloat16 or float16, got {_dtype(x)}")
    if not (_dtype(key) == _dtype(value) == _dtype(query)):
        raise TypeError(
            f"flash_attention: query, key and value must share a dtype, got {_dtype(query)}, {_dtype(key)}, {_dtype(value)}"
        )
    b, t, h, d = _shape(query)
    bk, s, kh, dk = _shape(key)
    if bk != b or _shape(value)[0] != b:
        raise ValueError(f"flash_attention: batch sizes differ: query {b}, key {bk}, value {_shape(value)[0]}")
    if dk != d:
        raise ValueError(
            f"flash_attention: key head dim must equal query head dim {d}, got key shape {list(_shape(key))}"
        )
    if _shape(value)[1:3] != (s, kh):
        raise ValueError(
            f"flash_attention: value must be [B, S, K, Dv] = [{b}, {s}, {kh}, Dv] like key, got {list(_shape(value))}"
        )
    if kh == 0 or h % kh:
        raise ValueError(f"flash_attention: query heads H={h} must be a multiple of key/value heads K={kh}")
    if bias is not None:
        _broadcastable("bias", bias, (b, h, t, s))
        if _dtype(bias) not in _FLOAT_DTYPES:
            raise TypeError(f"flash_attention: bias must be a float array, got {_dtype(bias)}")
    if attention_mask is not None:
        _broadcastable("attention_mask", attention_mask, (b, h, t, s))
        if _dtype(attention_mask) != "bool":
            raise TypeError(
                f"flash_attention: attention_mask must be bool (True = attend), got {_dtype(attention_mask)}"
            )
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("flash_attention: pass both q_segment_ids and kv_segment_ids, or neither")
    if q_segment_ids is not None:
        for name, x, want in (("q_segment_ids", q_segment_ids, (b, t)), ("kv_segment_ids", kv_segment_ids, (b, s))):
            if _shape(x) != want or not _is_int(x):
                raise ValueError(
                    f"flash_attention: {name} must be an integer array of shape {list(want)}, got {_dtype(x)}{list(_shape(x))}"
                )
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("flash_attention: pass both cu_seqlens_q and cu_seqlens_k, or neither")
    if cu_seqlens_q is not None:
        if q_segment_ids is not None:
            raise ValueError(
                "flash_attention: cu_seqlens_q/cu_seqlens_k and q_segment_ids/kv_segment_ids both pack sequences; pass one"
            )
        if b != 1:
            raise ValueError(
                f"flash_attention: with cu_seqlens_q the sequences are packed along T, so batch must be 1, got {b}"
            )
        n = _shape(cu_seqlens_q)
        for name, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if len(_shape(x)) != 1 or _shape(x)[0] < 2 or not _is_int(x):
                raise ValueError(
                    f"flash_attention: {name} must be a 1-D integer array [N+1] with N >= 1, got {_dtype(x)}{list(_shape(x))}"
                )
        if _shape(cu_seqlens_k) != n:
            raise ValueError(
                f"flash_attention: cu_seqlens_q and cu_seqlens_k must have the same length, got {n[0]} and {_shape(cu_seqlens_k)[0]}"
            )
    if softmax_scale is not None and not isinstance(softmax_scale, int | float):
        raise TypeError(
            f"flash_attention: softmax_scale must be a Python float or None, got {type(softmax_scale).__name__}"
        )
    if not isinstance(causal, bool):
        raise TypeError(f"flash_attention: causal must be a bool, got {type(causal).__name__}")
    if sliding_window is not None:
        w = (sliding_window, sliding_window) if isinstance(sliding_window, int) else sliding_window
        if not (isinstance(w, tuple | list) and len(w) == 2 and all(isinstance(x, int) and x >= 0 for x in w)):
            raise ValueError(
                f"flash_attention: sliding_window must be an int >= 0 or a pair (left, right) of ints >= 0, got {sliding_window!r}"
            )
    if logits_soft_cap is not None and not (isinstance(logits_soft_cap, int | float) and logits_soft_cap > 0):
        raise ValueError(f"flash_attention: logits_soft_cap must be a positive float or None, got {logits_soft_cap!r}")
    if not (isinstance(dropout_prob, int | float) and 0.0 <= dropout_prob < 1.0):
        raise ValueError(f"flash_attention: dropout_prob must be a float in [0, 1), got {dropout_prob!r}")
    if dropout_prob > 0 and dropout_seed is None:
        raise ValueError("flash_attention: dropout_prob > 0 needs dropout_seed (an int or a scalar integer array)")
    if (
        dropout_seed is not None
        and not isinstance(dropout_seed, int)
        and (_shape(dropout_seed) != () or not _is_int(dropout_seed))
    ):
        raise TypeError(
            f"flash_attention: dropout_seed must be an int or a scalar integer array, got {_dtype(dropout_seed)}{list(_shape(dropout_seed))}"
        )


def normalize_window(sliding_window: int | tuple[int, int] | None) -> tuple[int, int] | None:
    """``w`` -> ``(w, w)``; pairs pass through as tuples."""
    if sliding_window is None:
        return None
    if isinstance(sliding_window, int):
        return (sliding_window, sliding_window)
    return (int(sliding_window[0]), int(sliding_window[1]))


def mix32(x: Any, xp: Any = np) -> Any:
    """A 32-bit integer hash (lowbias32): cheap in every kernel language, good enough for dropout masks."""
    x = x.astype(xp.uint32)
    with np.errstate(over="ignore"):  # uint32 products wrap by design (numpy warns on scalars)
        x = x ^ (x >> 16)
        x = x * xp.uint32(0x7FEB352D)
        x = x ^ (x >> 15)
        x = x * xp.uint32(0x846CA68B)
        return x ^ (x >> 16)


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
