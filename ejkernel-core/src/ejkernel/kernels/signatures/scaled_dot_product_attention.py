"""The ``scaled_dot_product_attention`` contract: the semantics of ``jax.nn.dot_product_attention``.

Shapes (the letters of ``jax.nn.dot_product_attention``): B batch, T query length, S key length,
N query heads, K key/value heads (N % K == 0: GQA, MQA when K == 1; query head n reads kv head
n // (N // K)), H query/key head dim, Hv value head dim.

For query ``i`` and key ``j`` of batch ``b`` and head ``n``:

1. ``s = scale * q_i . k_j`` in float32 (``scale`` defaults to ``H ** -0.5``);
2. ``s += bias[b, n, i, j]``; ``bias`` is 4-D and broadcasts along every axis of size 1
   (``[B|1, N|1, T|1, S|1]``);
3. the key is admitted when all of these hold (the others are masked out):
   ``mask[b, n, i, j]`` (boolean, True = attend, broadcast like ``bias``);
   ``is_causal``: ``j <= i`` (top-left aligned: query i and key i share a position, also when T != S);
   ``local_window_size=(left, right)``: ``i - left <= j <= i + right`` (top-left aligned; an int
   ``w`` means ``(w, w)``);
   ``query_seq_lengths``: ``i < query_seq_lengths[b]``; ``key_value_seq_lengths``: ``j < key_value_seq_lengths[b]``;
4. softmax over the admitted keys, in float32;
5. ``out = P @ v`` in the dtype of ``query``.

A query row with no admitted key gives zeros, never NaN. This is where ejkernel departs from
``jax.nn.dot_product_attention(implementation="xla")``: jax gives such a row a uniform softmax over
all ``S`` keys, i.e. the mean of the values (except for rows past ``query_seq_lengths``, which jax
sets to zero too). Rows without keys arise from a ``mask`` row of False, a key/value sequence length
of 0, or a window when ``T > S`` (query ``i`` sees nothing once ``i - left > S - 1``). Everything else
agrees with jax: on rows with at least one admitted key both compute the same function.

Beyond jax: ``value`` may have its own head dim ``Hv`` (jax requires ``Hv == H``); the inputs must be
4-D (jax also takes 3-D ones without the batch axis).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jaxtyping import Array, Bool, Float, Int

from ejkernel.kernels.params import BwdParams, FwdParams

_FLOAT_DTYPES = ("float32", "bfloat16", "float16")
_OP = "scaled_dot_product_attention"


def scaled_dot_product_attention(
    query: Float[Array, "B T N H"],
    key: Float[Array, "B S K H"],
    value: Float[Array, "B S K Hv"],
    bias: Float[Array, "#B #N #T #S"] | None = None,
    mask: Bool[Array, "#B #N #T #S"] | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: Int[Array, "B"] | None = None,
    key_value_seq_lengths: Int[Array, "B"] | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    fwd_params: FwdParams | None = None,
    bwd_params: BwdParams | None = None,
) -> Float[Array, "B T N Hv"]:
    """Canonical signature of ``scaled_dot_product_attention`` (see the module docstring for the semantics)."""
    raise NotImplementedError


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(np.shape(x))


def _dtype(x: Any) -> str:
    return str(np.dtype(x.dtype)) if hasattr(x, "dtype") else type(x).__name__


def _broadcastable(name: str, x: Any, full: tuple[int, int, int, int]) -> None:
    shape = _shape(x)
    if len(shape) != 4 or any(s not in (1, f) for s, f in zip(shape, full)):
        want = ", ".join(f"{f}|1" for f in full)
        raise ValueError(f"{_OP}: {name} must be 4-D, broadcastable to [B, N, T, S]: [{want}], got {list(shape)}")


def validate(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: Any = None,
    key_value_seq_lengths: Any = None,
    local_window_size: int | tuple[int, int] | None = None,
    **_: Any,
) -> None:
    """Check a ``scaled_dot_product_attention`` call; raise an error naming the argument, what was expected and what came."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if len(_shape(x)) != 4:
            layout = {"query": "[B, T, N, H]", "key": "[B, S, K, H]", "value": "[B, S, K, Hv]"}[name]
            raise ValueError(f"{_OP}: {name} must be 4-D {layout}, got shape {list(_shape(x))}")
        if _dtype(x) not in _FLOAT_DTYPES:
            raise TypeError(f"{_OP}: {name} must be float32, bfloat16 or float16, got {_dtype(x)}")
    if not (_dtype(key) == _dtype(value) == _dtype(query)):
        raise TypeError(
            f"{_OP}: query, key and value must share a dtype, got {_dtype(query)}, {_dtype(key)}, {_dtype(value)}"
        )
    b, t, n, h = _shape(query)
    bk, s, k, hk = _shape(key)
    if bk != b or _shape(value)[0] != b:
        raise ValueError(f"{_OP}: batch sizes differ: query {b}, key {bk}, value {_shape(value)[0]}")
    if hk != h:
        raise ValueError(f"{_OP}: key head dim must equal query head dim {h}, got key shape {list(_shape(key))}")
    if _shape(value)[1:3] != (s, k):
        raise ValueError(
            f"{_OP}: value must be [B, S, K, Hv] = [{b}, {s}, {k}, Hv] like key, got {list(_shape(value))}"
        )
    if k == 0 or n % k:
        raise ValueError(f"{_OP}: query heads N={n} must be a multiple of key/value heads K={k}")
    if bias is not None:
        _broadcastable("bias", bias, (b, n, t, s))
        if _dtype(bias) not in _FLOAT_DTYPES:
            raise TypeError(f"{_OP}: bias must be a float array (float32, bfloat16 or float16), got {_dtype(bias)}")
    if mask is not None:
        _broadcastable("mask", mask, (b, n, t, s))
        if _dtype(mask) != "bool":
            raise TypeError(
                f"{_OP}: mask must be bool (True = attend; pass an additive mask as bias), got {_dtype(mask)}"
            )
    for name, x in (("query_seq_lengths", query_seq_lengths), ("key_value_seq_lengths", key_value_seq_lengths)):
        if x is not None and (
            _shape(x) != (b,) or not hasattr(x, "dtype") or not np.issubdtype(np.dtype(x.dtype), np.integer)
        ):
            raise ValueError(
                f"{_OP}: {name} must be an integer array of shape [B] = [{b}], got {_dtype(x)}{list(_shape(x))}"
            )
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, int | float | np.integer | np.floating)):
        raise TypeError(f"{_OP}: scale must be a Python float (or a NumPy scalar) or None, got {type(scale).__name__}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"{_OP}: is_causal must be a bool, got {type(is_causal).__name__}")
    if local_window_size is not None:
        w = (local_window_size, local_window_size) if isinstance(local_window_size, int) else local_window_size
        if not (
            isinstance(w, tuple | list)
            and len(w) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in w)
        ):
            raise ValueError(
                f"{_OP}: local_window_size must be an int >= 0 or a pair (left, right) of ints >= 0, got {local_window_size!r}"
            )
