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

The op is defined here once: this contract, ``validate``, the ``Kernel`` and the public function, whose
parameters are the canonical signature (``ejkernel.kernels.signatures.canonical_signature``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from ejkernel.kernels.signatures._checks import (
    ArrayIn,
    check_bool,
    check_query_key_value,
    check_scale,
    check_segment_ids,
    check_soft_cap,
    dtype_name,
    is_count,
    shape,
)
from ejkernel.modules.operations._dispatch import dispatch
from ejkernel.modules.operations._empty import attention_zeros
from ejkernel.modules.operations._typecheck import checked
from ejkernel.modules.operations.configs import BlockSparseAttentionConfig
from ejkernel.ops import Invocation, Kernel

OP = "block_sparse_attention"


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


def _check_patterns(q_block: Any, kv_block: Any, local_blocks: Any, global_blocks: Any, who: str) -> None:
    for name, x in (("q_block", q_block), ("kv_block", kv_block)):
        if not is_count(x, 1):
            raise ValueError(f"{who}: {name} must be an int >= 1, got {x!r}")
    if local_blocks is not None:
        pair = (local_blocks, local_blocks) if isinstance(local_blocks, int | np.integer) else local_blocks
        if not (isinstance(pair, tuple | list) and len(pair) == 2 and all(is_count(x, 0) for x in pair)):
            raise ValueError(
                f"{who}: local_blocks must be an int >= 0 or a pair (left, right) of ints >= 0, got {local_blocks!r}"
            )
    if not is_count(global_blocks, 0):
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
    q, k = check_query_key_value(OP, query, key, value)
    b, t, h, s = q[0], q[1], q[2], k[1]
    if t < 1 or s < 1:
        raise ValueError(f"{OP}: query and key lengths must be >= 1, got T={t}, S={s}")
    _check_patterns(q_block, kv_block, local_blocks, global_blocks, OP)
    if block_mask is not None:
        if local_blocks is not None or global_blocks:
            raise ValueError(
                f"{OP}: pass block_mask or the patterns (local_blocks/global_blocks), not both; "
                f"got block_mask and local_blocks={local_blocks!r}, global_blocks={global_blocks!r}"
            )
        nq, nk = _cdiv(t, q_block), _cdiv(s, kv_block)
        got = shape(block_mask)
        if len(got) != 4 or got[0] not in (1, b) or got[1] not in (1, h) or got[2:] != (nq, nk):
            raise ValueError(
                f"{OP}: block_mask must have shape [B|1, H|1, ceil(T/q_block), ceil(S/kv_block)] = "
                f"[{b}|1, {h}|1, {nq}, {nk}] (T={t}, q_block={q_block}, S={s}, kv_block={kv_block}), got {list(got)}"
            )
        if dtype_name(block_mask) != "bool":
            raise TypeError(f"{OP}: block_mask must be bool (True = attend), got {dtype_name(block_mask)}")
    check_segment_ids(OP, q_segment_ids, kv_segment_ids, b, t, s)
    check_scale(OP, "softmax_scale", softmax_scale)
    check_bool(OP, "causal", causal)
    check_soft_cap(OP, logits_soft_cap)


class BlockSparseAttention(Kernel[BlockSparseAttentionConfig]):
    op_id = "block_sparse_attention"
    config_type = BlockSparseAttentionConfig

    def normalize(self, arguments: dict[str, Any]) -> dict[str, Any]:
        d = arguments["query"].shape[-1]
        arguments["softmax_scale"] = float(
            d**-0.5 if arguments["softmax_scale"] is None else arguments["softmax_scale"]
        )
        if arguments["logits_soft_cap"] is not None:
            arguments["logits_soft_cap"] = float(arguments["logits_soft_cap"])
        arguments["local_blocks"] = normalize_local(arguments["local_blocks"])
        for name in ("q_block", "kv_block", "global_blocks"):
            arguments[name] = int(arguments[name])
        return arguments

    def make_inputs(self, inv: Invocation, seed: int = 0) -> dict[str, Any]:
        inputs = super().make_inputs(inv, seed)
        mask = inv.arguments.get("block_mask")
        if isinstance(mask, jax.ShapeDtypeStruct):
            # A typical sparse pattern (a band and a global column) rather than a dense all-True mask.
            a = inv.arguments
            band = block_sparse_mask(
                a["query"].shape[1],
                a["key"].shape[1],
                q_block=a["q_block"],
                kv_block=a["kv_block"],
                local_blocks=1,
                global_blocks=1,
                causal=a["causal"],
            )
            inputs["block_mask"] = jax.numpy.asarray(np.broadcast_to(band, mask.shape))
        return inputs

    def empty_result(self, arguments: Mapping[str, Any]) -> Any:
        return attention_zeros(arguments)  # no batch or heads (validate refuses T == 0 and S == 0)


_kernel = BlockSparseAttention()


@checked
def block_sparse_attention(
    query: Float[ArrayIn, "B T H D"],
    key: Float[ArrayIn, "B S K D"],
    value: Float[ArrayIn, "B S K Dv"],
    *,
    block_mask: Bool[ArrayIn, "#B #H NQ NK"] | None = None,
    q_segment_ids: Int[ArrayIn, "B T"] | None = None,
    kv_segment_ids: Int[ArrayIn, "B S"] | None = None,
    q_block: int = 64,
    kv_block: int = 64,
    local_blocks: int | tuple[int, int] | None = None,
    global_blocks: int = 0,
    causal: bool = False,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    platform: str | None = None,
    backend: str | None = None,
    cfg: BlockSparseAttentionConfig | None = None,
    mesh: jax.sharding.Mesh | None = None,
    in_specs: Any = None,
    out_specs: Any = None,
) -> Float[Array, "B T H Dv"]:
    """Attention restricted to the key blocks a block mask admits per query block; blocks it rules out cost nothing.

    Shapes: B batch, T query length, S key length, H query heads, K key/value heads (H % K == 0:
    GQA, MQA when K == 1), D head dim, Dv value head dim, NQ = ceil(T / q_block), NK = ceil(S / kv_block).

    Args:
        query: ``[B, T, H, D]``.
        key: ``[B, S, K, D]``.
        value: ``[B, S, K, Dv]``.
        block_mask: boolean ``[B|1, H|1, NQ, NK]``: True where query block ``i // q_block`` may attend
            key block ``j // kv_block``. None: the mask of the patterns below (``block_sparse_mask``).
        q_segment_ids, kv_segment_ids: ``[B, T]`` and ``[B, S]`` ints; attend only within equal ids.
        q_block, kv_block: the mask's granularity in tokens (the last block of each may be partial).
        local_blocks: ``(left, right)`` key blocks around each query block's diagonal (``w``: ``(w, w)``).
        global_blocks: the first ``g`` key blocks are seen by all, and the first ``g`` query blocks see all.
        causal: query i attends keys ``j <= i + S - T`` (bottom-right aligned), token by token.
        softmax_scale: scale of the scores, default ``D ** -0.5``.
        logits_soft_cap: ``cap * tanh(scores / cap)`` before masking.
        platform: restrict to one kernel platform (``"xla"``, ``"pallas"``, ...); default: any.
        backend: run for this backend (``"cpu"``, ``"gpu"``, ``"tpu"``); default: JAX's default device.
        cfg: a ``BlockSparseAttentionConfig`` that overrides the config chain (never cached).
        mesh, in_specs, out_specs: run under ``jax.shard_map``; ``in_specs`` has one spec per array passed.

    Returns:
        ``[B, T, H, Dv]`` in ``query.dtype``. A query row with no admitted key gives zeros.

    Raises:
        ValueError, TypeError: a bad shape, dtype or option (the message names it).
        ejkernel.ops.ConfigError: no installed implementation can serve the call (the message says why).

    Example:

    >>> import jax, jax.numpy as jnp
    >>> from ejkernel.modules import block_sparse_attention, block_sparse_mask
    >>> q = jax.random.normal(jax.random.key(0), (1, 256, 4, 32))
    >>> k = v = jax.random.normal(jax.random.key(1), (1, 256, 2, 32))
    >>> block_sparse_mask(256, 256, local_blocks=(1, 0), global_blocks=1, causal=True).astype(int)
    array([[1, 0, 0, 0],
           [1, 1, 0, 0],
           [1, 1, 1, 0],
           [1, 0, 1, 1]])
    >>> block_sparse_attention(q, k, v, local_blocks=(1, 0), global_blocks=1, causal=True).shape
    (1, 256, 4, 32)
    """
    arrays = {
        "query": query,
        "key": key,
        "value": value,
        "block_mask": block_mask,
        "q_segment_ids": q_segment_ids,
        "kv_segment_ids": kv_segment_ids,
    }
    options = {
        "q_block": q_block,
        "kv_block": kv_block,
        "local_blocks": local_blocks,
        "global_blocks": global_blocks,
        "causal": causal,
        "softmax_scale": softmax_scale,
        "logits_soft_cap": logits_soft_cap,
    }
    return dispatch(
        _kernel,
        arrays,
        options,
        platform=platform,
        backend=backend,
        cfg=cfg,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
    )
