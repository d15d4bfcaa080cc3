"""The ``native_sparse_attention`` contract (DeepSeek's NSA, with the semantics of flash-linear-attention's ``nsa``).

Shapes: B batch, T query length, S key length, H query heads, K key/value heads (H % K == 0;
query head h reads kv head h // (H // K), and the H // K heads of a group share their kv head's
selection), D query/key head dim, Dv value head dim, N selection slots per query token,
NB = ceil(S / block_size) key blocks (block n holds keys ``[n * block_size, min((n + 1) * block_size, S))``).

Positions are bottom-right aligned (as FlashAttention 2): query token i sits at position
``p(i) = i + S - T`` of the key sequence. ``scale = softmax_scale`` (default ``D ** -0.5``).

Three branches, each a softmax attention computed in float32; a row with no admitted key gives
zeros (never NaN):

1. **Selected** (always). The blocks of query token i for kv head k are the *set*
   ``{block_indices[b, i, k, n] : n < count}`` where ``count = block_counts`` (an int, or
   ``block_counts[b, i, k]``; all N slots when None). Indices outside ``[0, NB)`` (``-1`` pads)
   are ignored, and a block listed twice counts once. The query attends the keys of those blocks,
   with ``j <= p(i)`` when ``causal``. This gives ``o_slc``.
2. **Compressed** (when ``g_cmp`` is given). The keys and values are mean-pooled per block:
   ``k_cmp[b, n, k] = mean(key[b, j, k] for j in block n)`` (the last block averages the keys it
   has), likewise ``v_cmp``. Query i attends compressed block n when ``causal`` is False, or when
   the block is complete up to its position: ``(n + 1) * block_size - 1 <= p(i)``. This gives ``o_cmp``.
3. **Sliding window** (when ``window_size > 0``; then ``g_swa`` is required). Query i attends keys
   ``p(i) - window_size < j <= p(i)`` (the ``window_size`` latest keys) when ``causal``, else
   ``|j - p(i)| < window_size``. This gives ``o_swa``.

``out = g_slc * o_slc + g_cmp * o_cmp + g_swa * o_swa`` per query head (a gate ``[B, T, H]``
multiplies every channel of the head; a missing ``g_slc`` is 1, a missing ``g_cmp``/``g_swa``
drops its branch), summed in float32 and cast to ``query.dtype``.

Differentiable in ``query``, ``key``, ``value`` and the gates; ``block_indices`` and
``block_counts`` are not. The top-k selection of blocks (from compressed scores) is the caller's:
this op takes the indices it chose.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jaxtyping import Array, Float, Int

from ejkernel.kernels.params import BwdParams, FwdParams

_FLOAT_DTYPES = ("float32", "bfloat16", "float16")
OP = "native_sparse_attention"


def native_sparse_attention(
    query: Float[Array, "B T H D"],
    key: Float[Array, "B S K D"],
    value: Float[Array, "B S K Dv"],
    block_indices: Int[Array, "B T K N"],
    *,
    block_counts: int | Int[Array, "B T K"] | None = None,
    g_slc: Float[Array, "B T H"] | None = None,
    g_cmp: Float[Array, "B T H"] | None = None,
    g_swa: Float[Array, "B T H"] | None = None,
    block_size: int = 64,
    window_size: int = 0,
    softmax_scale: float | None = None,
    causal: bool = True,
    fwd_params: FwdParams | None = None,
    bwd_params: BwdParams | None = None,
) -> Float[Array, "B T H Dv"]:
    """Canonical signature of ``native_sparse_attention`` (see the module docstring for the semantics)."""
    raise NotImplementedError


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(np.shape(x))


def _dtype(x: Any) -> str:
    return str(np.dtype(x.dtype)) if hasattr(x, "dtype") else type(x).__name__


def _is_int(x: Any) -> bool:
    return hasattr(x, "dtype") and np.issubdtype(np.dtype(x.dtype), np.integer)


def _is_count(x: Any, minimum: int) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool) and bool(x >= minimum)


def validate(
    query: Any,
    key: Any,
    value: Any,
    block_indices: Any,
    *,
    block_counts: Any = None,
    g_slc: Any = None,
    g_cmp: Any = None,
    g_swa: Any = None,
    block_size: int = 64,
    window_size: int = 0,
    softmax_scale: float | None = None,
    causal: bool = True,
    **_: Any,
) -> None:
    """Check a ``native_sparse_attention`` call; raise an error naming the argument, what was expected and what came."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if len(_shape(x)) != 4:
            layout = {"query": "[B, T, H, D]", "key": "[B, S, K, D]", "value": "[B, S, K, Dv]"}[name]
            raise ValueError(f"{OP}: {name} must be 4-D {layout}, got shape {list(_shape(x))}")
        if _dtype(x) not in _FLOAT_DTYPES:
            raise TypeError(f"{OP}: {name} must be float32, bfloat16 or float16, got {_dtype(x)}")
    if not (_dtype(key) == _dtype(value) == _dtype(query)):
        raise TypeError(
            f"{OP}: query, key and value must share a dtype, got {_dtype(query)}, {_dtype(key)}, {_dtype(value)}"
        )
    b, t, h, d = _shape(query)
    bk, s, kh, dk = _shape(key)
    if bk != b or _shape(value)[0] != b:
        raise ValueError(f"{OP}: batch sizes differ: query {b}, key {bk}, value {_shape(value)[0]}")
    if t < 1 or s < 1:
        raise ValueError(f"{OP}: query and key lengths must be >= 1, got T={t}, S={s}")
    if dk != d:
        raise ValueError(f"{OP}: key head dim must equal query head dim {d}, got key shape {list(_shape(key))}")
    if _shape(value)[1:3] != (s, kh):
        raise ValueError(
            f"{OP}: value must be [B, S, K, Dv] = [{b}, {s}, {kh}, Dv] like key, got {list(_shape(value))}"
        )
    if kh == 0 or h % kh:
        raise ValueError(f"{OP}: query heads H={h} must be a multiple of key/value heads K={kh}")
    shape = _shape(block_indices)
    if len(shape) != 4 or shape[:3] != (b, t, kh) or shape[3] < 1 or not _is_int(block_indices):
        raise ValueError(
            f"{OP}: block_indices must be an integer array [B, T, K, N] = [{b}, {t}, {kh}, N >= 1], "
            f"got {_dtype(block_indices)}{list(shape)}"
        )
    if block_counts is not None:
        if hasattr(block_counts, "shape"):
            if _shape(block_counts) != (b, t, kh) or not _is_int(block_counts):
                raise ValueError(
                    f"{OP}: block_counts must be an int >= 0 or an integer array [B, T, K] = [{b}, {t}, {kh}], "
                    f"got {_dtype(block_counts)}{list(_shape(block_counts))}"
                )
        elif not _is_count(block_counts, 0):
            raise ValueError(
                f"{OP}: block_counts must be an int >= 0 or an integer array [B, T, K], got {block_counts!r}"
            )
    for name, g in (("g_slc", g_slc), ("g_cmp", g_cmp), ("g_swa", g_swa)):
        if g is None:
            continue
        if _shape(g) != (b, t, h):
            raise ValueError(f"{OP}: {name} must have shape [B, T, H] = [{b}, {t}, {h}], got {list(_shape(g))}")
        if _dtype(g) not in _FLOAT_DTYPES:
            raise TypeError(f"{OP}: {name} must be float32, bfloat16 or float16, got {_dtype(g)}")
    if not _is_count(block_size, 1):
        raise ValueError(f"{OP}: block_size must be an int >= 1, got {block_size!r}")
    if not _is_count(window_size, 0):
        raise ValueError(f"{OP}: window_size must be an int >= 0, got {window_size!r}")
    if window_size > 0 and g_swa is None:
        raise ValueError(f"{OP}: window_size={window_size} enables the sliding branch, which needs its gate g_swa")
    if window_size == 0 and g_swa is not None:
        raise ValueError(f"{OP}: g_swa gates the sliding branch, which needs window_size > 0 (got window_size=0)")
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, int | float)):
        raise TypeError(f"{OP}: softmax_scale must be a Python float or None, got {type(softmax_scale).__name__}")
    if not isinstance(causal, bool):
        raise TypeError(f"{OP}: causal must be a bool, got {type(causal).__name__}")
