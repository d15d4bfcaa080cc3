"""``block_sparse_attention``: the public function and its operations-layer ``Kernel``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from ejkernel.kernels.signatures.block_sparse_attention import block_sparse_mask, normalize_local
from ejkernel.modules.operations._dispatch import dispatch
from ejkernel.modules.operations._empty import attention_zeros
from ejkernel.modules.operations.configs import BlockSparseAttentionConfig
from ejkernel.ops import Invocation, Kernel


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
