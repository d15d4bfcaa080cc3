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
from ejkernel.kernels.signatures._checks import (
    check_bool,
    check_float,
    check_query_key_value,
    check_window,
    describe,
    dtype_name,
    is_int_array,
    shape,
)

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


def _check_broadcastable(name: str, x: Any, full: tuple[int, int, int, int]) -> None:
    got = shape(x)
    if len(got) != 4 or any(g not in (1, f) for g, f in zip(got, full)):
        want = ", ".join(f"{f}|1" for f in full)
        raise ValueError(f"{_OP}: {name} must be 4-D, broadcastable to [B, N, T, S]: [{want}], got {list(got)}")


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
    q, k = check_query_key_value(_OP, query, key, value, layouts=("[B, T, N, H]", "[B, S, K, H]", "[B, S, K, Hv]"))
    b, t, n, s = q[0], q[1], q[2], k[1]
    if bias is not None:
        _check_broadcastable("bias", bias, (b, n, t, s))
        check_float(_OP, "bias", bias)
    if mask is not None:
        _check_broadcastable("mask", mask, (b, n, t, s))
        if dtype_name(mask) != "bool":
            raise TypeError(
                f"{_OP}: mask must be bool (True = attend; pass an additive mask as bias), got {dtype_name(mask)}"
            )
    for name, x in (("query_seq_lengths", query_seq_lengths), ("key_value_seq_lengths", key_value_seq_lengths)):
        if x is not None and (shape(x) != (b,) or not is_int_array(x)):
            raise ValueError(f"{_OP}: {name} must be an integer array of shape [B] = [{b}], got {describe(x)}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, int | float | np.integer | np.floating)):
        raise TypeError(f"{_OP}: scale must be a Python float (or a NumPy scalar) or None, got {type(scale).__name__}")
    check_bool(_OP, "is_causal", is_causal)
    check_window(_OP, "local_window_size", local_window_size)
