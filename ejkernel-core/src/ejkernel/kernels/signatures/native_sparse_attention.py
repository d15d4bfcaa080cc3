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

from jaxtyping import Array, Float, Int

from ejkernel.kernels.params import BwdParams, FwdParams
from ejkernel.kernels.signatures._checks import (
    check_bool,
    check_float,
    check_query_key_value,
    check_scale,
    describe,
    is_count,
    is_int_array,
    shape,
)

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
    q, k = check_query_key_value(OP, query, key, value)
    b, t, h, s, kh = q[0], q[1], q[2], k[1], k[2]
    if t < 1 or s < 1:
        raise ValueError(f"{OP}: query and key lengths must be >= 1, got T={t}, S={s}")
    got = shape(block_indices)
    if len(got) != 4 or got[:3] != (b, t, kh) or got[3] < 1 or not is_int_array(block_indices):
        raise ValueError(
            f"{OP}: block_indices must be an integer array [B, T, K, N] = [{b}, {t}, {kh}, N >= 1], "
            f"got {describe(block_indices)}"
        )
    if block_counts is not None:
        if hasattr(block_counts, "shape"):
            if shape(block_counts) != (b, t, kh) or not is_int_array(block_counts):
                raise ValueError(
                    f"{OP}: block_counts must be an int >= 0 or an integer array [B, T, K] = [{b}, {t}, {kh}], "
                    f"got {describe(block_counts)}"
                )
        elif not is_count(block_counts, 0):
            raise ValueError(
                f"{OP}: block_counts must be an int >= 0 or an integer array [B, T, K], got {block_counts!r}"
            )
    for name, g in (("g_slc", g_slc), ("g_cmp", g_cmp), ("g_swa", g_swa)):
        if g is None:
            continue
        if shape(g) != (b, t, h):
            raise ValueError(f"{OP}: {name} must have shape [B, T, H] = [{b}, {t}, {h}], got {list(shape(g))}")
        check_float(OP, name, g)
    if not is_count(block_size, 1):
        raise ValueError(f"{OP}: block_size must be an int >= 1, got {block_size!r}")
    if not is_count(window_size, 0):
        raise ValueError(f"{OP}: window_size must be an int >= 0, got {window_size!r}")
    if window_size > 0 and g_swa is None:
        raise ValueError(f"{OP}: window_size={window_size} enables the sliding branch, which needs its gate g_swa")
    if window_size == 0 and g_swa is not None:
        raise ValueError(f"{OP}: g_swa gates the sliding branch, which needs window_size > 0 (got window_size=0)")
    check_scale(OP, "softmax_scale", softmax_scale)
    check_bool(OP, "causal", causal)
