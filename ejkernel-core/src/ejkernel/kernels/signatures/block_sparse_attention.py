"""The ``block_sparse_attention`` contract.

Shapes: B batch, T query length, S key length, H query heads, K key/value heads (H % K == 0;
query head h reads kv head h // (H // K)), D query/key head dim, Dv value head dim,
NQ = ceil(T / q_block) query blocks, NK = ceil(S / kv_block) key blocks.

Query token i lies in query block ``i // q_block``, key token j in key block ``j // kv_block`` (the
last block of each may be partial). ``q_block``/``kv_block`` are the granularity of the block mask:
part of the call's meaning, not launch parameters (an implementation computes on tiles of its own).

Semantics, in the order they apply to the scores of query i and key j (batch b, query head h):

1. ``s = softmax_scale * q_i . k_j`` (``softmax_scale`` defaults to ``D ** -0.5``);
2. ``s = logits_soft_cap * tanh(s / logits_soft_cap)`` when a cap is given;
3. the key is masked out unless all of these hold:
   - the block mask admits the pair: ``block_mask[b, h, i // q_block, j // kv_block]`` (dims of size 1
     broadcast); when ``block_mask`` is None, the mask built by ``block_sparse_mask`` from
     ``local_blocks``/``global_blocks``/``causal`` (below);
   - ``causal``: ``j <= i + S - T`` (bottom-right aligned, as FlashAttention 2), applied token by
     token, also inside the blocks on the diagonal;
   - equal segment ids, when ``q_segment_ids``/``kv_segment_ids`` are given;
4. softmax over the admitted keys in float32; a row with no admitted key gives zeros (never NaN),
   and zero gradients;
5. ``out = P @ v`` in the dtype of ``query``.

The patterns (``block_sparse_mask``), for query block ``qb`` and key block ``kb``. The diagonal of
``qb`` is the key blocks that hold the aligned positions ``i + S - T`` of its tokens:
``first(qb) = floor((qb * q_block + S - T) / kv_block)`` to
``last(qb) = floor((min((qb + 1) * q_block, T) - 1 + S - T) / kv_block)`` (for T == S and equal
blocks, just ``kb == qb``). Then

- ``local_blocks=(left, right)`` (an int ``w`` means ``(w, w)``): ``first(qb) - left <= kb <= last(qb) + right``;
- ``global_blocks=g``: the first ``g`` key blocks are seen by every query block, and the first ``g``
  query blocks see every key block (global tokens, as BigBird);
- the pattern is the union of the two; with neither (``local_blocks=None, global_blocks=0``) every block;
- ``causal`` also clears the blocks that lie wholly after the diagonal (``kb * kv_block > last
  aligned position of qb``), which the token-wise causal mask would empty anyway.

``block_mask`` and the patterns are exclusive: pass one or the other. ``causal`` combines with both.
Differentiable in ``query``, ``key`` and ``value``; the masks and segment ids are not.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jaxtyping import Array, Bool, Float, Int

from ejkernel.kernels.params import BwdParams, FwdParams

_FLOAT_DTYPES = ("float32", "bfloat16", "float16")
OP = "block_sparse_attention"


def block_sparse_attention(
    query: Float[Array, "B T H D"],
    key: Float[Array, "B S K D"],
    value: Float[Array, "B S K Dv"],
    *,
    block_mask: Bool[Array, "#B #H NQ NK"] | None = None,
    q_segment_ids: Int[Array, "B T"] | None = None,
    kv_segment_ids: Int[Array, "B S"] | None = None,
    q_block: int = 64,
    kv_block: int = 64,
    local_blocks: int | tuple[int, int] | None = None,
    global_blocks: int = 0,
    causal: bool = False,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    fwd_params: FwdParams | None = None,
    bwd_params: BwdParams | None = None,
) -> Float[Array, "B T H Dv"]:
    """Canonical signature of ``block_sparse_attention`` (see the module docstring for the semantics)."""
    raise NotImplementedError


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def normalize_local(local_blocks: int | tuple[int, int] | None) -> tuple[int, int] | None:
    """``w`` -> ``(w, w)``; pairs pass through as tuples of ints."""
    if local_blocks is None:
        return None
    if isinstance(local_blocks, int | np.integer):
        return (int(local_blocks), int(local_blocks))
    return (int(local_blocks[0]), int(local_blocks[1]))


def block_sparse_mask(
    q_len: int,
    kv_len: int,
    *,
    q_block: int = 64,
    kv_block: int = 64,
    local_blocks: int | tuple[int, int] | None = None,
    global_blocks: int = 0,
    causal: bool = False,
) -> np.ndarray:
    """The ``[NQ, NK]`` boolean block mask of the patterns (True = the block pair is attended).

    This is the mask ``block_sparse_attention`` uses when it is given no ``block_mask``; see the module
    docstring for the exact rules.

    >>> block_sparse_mask(4, 4, q_block=1, kv_block=1, local_blocks=(1, 0), global_blocks=1).astype(int)
    array([[1, 1, 1, 1],
           [1, 1, 0, 0],
           [1, 1, 1, 0],
           [1, 0, 1, 1]])
    """
    _check_patterns(q_block, kv_block, local_blocks, global_blocks, "block_sparse_mask")
    nq, nk = _cdiv(q_len, q_block), _cdiv(kv_len, kv_block)
    qb = np.arange(nq)[:, None]
    kb = np.arange(nk)[None, :]
    offset = kv_len - q_len
    first_pos = qb * q_block + offset  # aligned position of the block's first and last query
    last_pos = np.minimum((qb + 1) * q_block, q_len) - 1 + offset
    local = normalize_local(local_blocks)
    if local is None and global_blocks == 0:
        mask = np.ones((nq, nk), bool)
    else:
        mask = np.zeros((nq, nk), bool)
        if local is not None:
            mask |= (kb >= first_pos // kv_block - local[0]) & (kb <= last_pos // kv_block + local[1])
        if global_blocks:
            mask |= (kb < global_blocks) | (qb < global_blocks)
    if causal:
        mask &= kb * kv_block <= last_pos
    return mask


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(np.shape(x))


def _dtype(x: Any) -> str:
    return str(np.dtype(x.dtype)) if hasattr(x, "dtype") else type(x).__name__


def _is_int(x: Any) -> bool:
    return hasattr(x, "dtype") and np.issubdtype(np.dtype(x.dtype), np.integer)


def _is_count(x: Any, minimum: int) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool) and bool(x >= minimum)


def _check_patterns(q_block: Any, kv_block: Any, local_blocks: Any, global_blocks: Any, who: str) -> None:
    for name, x in (("q_block", q_block), ("kv_block", kv_block)):
        if not _is_count(x, 1):
            raise ValueError(f"{who}: {name} must be an int >= 1, got {x!r}")
    if local_blocks is not None:
        pair = (local_blocks, local_blocks) if isinstance(local_blocks, int | np.integer) else local_blocks
        if not (isinstance(pair, tuple | list) and len(pair) == 2 and all(_is_count(x, 0) for x in pair)):
            raise ValueError(
                f"{who}: local_blocks must be an int >= 0 or a pair (left, right) of ints >= 0, got {local_blocks!r}"
            )
    if not _is_count(global_blocks, 0):
        raise ValueError(f"{who}: global_blocks must be an int >= 0, got {global_blocks!r}")


def validate(
    query: Any,
    key: Any,
    value: Any,
    *,
    block_mask: Any = None,
    q_segment_ids: Any = None,
    kv_segment_ids: Any = None,
    q_block: int = 64,
    kv_block: int = 64,
    local_blocks: int | tuple[int, int] | None = None,
    global_blocks: int = 0,
    causal: bool = False,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    **_: Any,
) -> None:
    """Check a ``block_sparse_attention`` call; raise an error naming the argument, what was expected and what came."""
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
    _check_patterns(q_block, kv_block, local_blocks, global_blocks, OP)
    if block_mask is not None:
        if local_blocks is not None or global_blocks:
            raise ValueError(
                f"{OP}: pass block_mask or the patterns (local_blocks/global_blocks), not both; "
                f"got block_mask and local_blocks={local_blocks!r}, global_blocks={global_blocks!r}"
            )
        nq, nk = _cdiv(t, q_block), _cdiv(s, kv_block)
        shape = _shape(block_mask)
        if len(shape) != 4 or shape[0] not in (1, b) or shape[1] not in (1, h) or shape[2:] != (nq, nk):
            raise ValueError(
                f"{OP}: block_mask must have shape [B|1, H|1, ceil(T/q_block), ceil(S/kv_block)] = "
                f"[{b}|1, {h}|1, {nq}, {nk}] (T={t}, q_block={q_block}, S={s}, kv_block={kv_block}), got {list(shape)}"
            )
        if _dtype(block_mask) != "bool":
            raise TypeError(f"{OP}: block_mask must be bool (True = attend), got {_dtype(block_mask)}")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError(f"{OP}: pass both q_segment_ids and kv_segment_ids, or neither")
    if q_segment_ids is not None:
        for name, x, want in (("q_segment_ids", q_segment_ids, (b, t)), ("kv_segment_ids", kv_segment_ids, (b, s))):
            if _shape(x) != want or not _is_int(x):
                raise ValueError(
                    f"{OP}: {name} must be an integer array of shape {list(want)}, got {_dtype(x)}{list(_shape(x))}"
                )
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, int | float)):
        raise TypeError(f"{OP}: softmax_scale must be a Python float or None, got {type(softmax_scale).__name__}")
    if not isinstance(causal, bool):
        raise TypeError(f"{OP}: causal must be a bool, got {type(causal).__name__}")
    if logits_soft_cap is not None and not (isinstance(logits_soft_cap, int | float) and logits_soft_cap > 0):
        raise ValueError(f"{OP}: logits_soft_cap must be a positive float or None, got {logits_soft_cap!r}")
