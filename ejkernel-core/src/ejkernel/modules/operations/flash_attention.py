"""``flash_attention``: the public function and its operations-layer ``Kernel``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from ejkernel.kernels.signatures.flash_attention import normalize_window, seed_from_query
from ejkernel.modules.operations._dispatch import dispatch
from ejkernel.modules.operations._empty import attention_zeros
from ejkernel.modules.operations.configs import FlashAttentionConfig
from ejkernel.ops import Invocation, Kernel


class FlashAttention(Kernel[FlashAttentionConfig]):
    op_id = "flash_attention"
    config_type = FlashAttentionConfig

    def normalize(self, arguments: dict[str, Any]) -> dict[str, Any]:
        d = arguments["query"].shape[-1]
        arguments["sliding_window"] = normalize_window(arguments["sliding_window"])
        arguments["softmax_scale"] = float(
            d**-0.5 if arguments["softmax_scale"] is None else arguments["softmax_scale"]
        )
        if arguments["logits_soft_cap"] is not None:
            arguments["logits_soft_cap"] = float(arguments["logits_soft_cap"])
        arguments["dropout_prob"] = float(arguments["dropout_prob"])
        if arguments["dropout_prob"] == 0.0:
            arguments["dropout_seed"] = None  # no dropout: the seed must not split cache entries
        elif arguments["dropout_seed"] is None:  # a fresh mask whenever the query changes (see the contract)
            arguments["dropout_seed"] = seed_from_query(arguments["query"])
        return arguments

    def make_inputs(self, inv: Invocation, seed: int = 0) -> dict[str, Any]:
        inputs = super().make_inputs(inv, seed)
        cu_q = inv.arguments.get("cu_seqlens_q")
        if isinstance(cu_q, jax.ShapeDtypeStruct):
            # Packed sequences of equal length: representative work for timing.
            n = cu_q.shape[0] - 1
            t, s = inv.arguments["query"].shape[1], inv.arguments["key"].shape[1]
            inputs["cu_seqlens_q"] = jax.numpy.asarray(np.linspace(0, t, n + 1).astype(np.int64), cu_q.dtype)
            inputs["cu_seqlens_k"] = jax.numpy.asarray(np.linspace(0, s, n + 1).astype(np.int64), cu_q.dtype)
        return inputs

    def empty_result(self, arguments: Mapping[str, Any]) -> Any:
        return attention_zeros(arguments)  # no queries, or no keys: rows that admit no key give zeros


_kernel = FlashAttention()


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
    platform: str | None = None,
    backend: str | None = None,
    cfg: FlashAttentionConfig | None = None,
    mesh: jax.sharding.Mesh | None = None,
    in_specs: Any = None,
    out_specs: Any = None,
) -> Float[Array, "B T H Dv"]:
    """Multi-head attention ``softmax(scale * q k^T + bias) v`` with masks, in O(T) memory where the kernel allows.

    Shapes: B batch, T query length, S key length, H query heads, K key/value heads (H % K == 0:
    GQA, MQA when K == 1), D head dim, Dv value head dim, N packed sequences.

    Args:
        query: ``[B, T, H, D]``.
        key: ``[B, S, K, D]``.
        value: ``[B, S, K, Dv]``.
        bias: added to the scaled scores, broadcastable ``[B|1, H|1, T, S]``; differentiable.
        attention_mask: boolean ``[B|1, H|1, T, S]``, True where a query may attend a key.
        q_segment_ids, kv_segment_ids: ``[B, T]`` and ``[B, S]`` ints; attend only within equal ids.
        softmax_scale: scale of the scores, default ``D ** -0.5``.
        causal: query i attends keys ``j <= i + S - T`` (bottom-right aligned, as FlashAttention 2).
        sliding_window: ``(left, right)`` keys around the aligned diagonal, or ``w`` for ``(w, w)``.
        logits_soft_cap: ``cap * tanh(scores / cap)`` before masking.
        dropout_prob, dropout_seed: attention dropout, the same mask for a seed on every backend. Without a
            seed, it is derived from the query's values: a new mask whenever the query changes (each training
            step, each layer), the same in the forward and backward; pass ``dropout_seed`` (e.g. the step
            number) to choose it.
        cu_seqlens_q, cu_seqlens_k: ``[N+1]`` offsets of packed sequences (B must be 1).
        platform: one implementation by name (``"xla"``, ``"cudnn"``, ``"triton"``, ``"mosaic_gpu"``; ``ejkernel
            info`` lists them), or all of a platform's (``"pallas"``); default: any.
        backend: run for this backend (``"cpu"``, ``"gpu"``, ``"tpu"``); default: JAX's default device.
        cfg: a ``FlashAttentionConfig`` that overrides the config chain (never cached).
        mesh, in_specs, out_specs: run under ``jax.shard_map``; ``in_specs`` has one spec per array passed.

    Returns:
        ``[B, T, H, Dv]`` in ``query.dtype``. A query row with no admitted key gives zeros.

    Raises:
        ValueError, TypeError: a bad shape, dtype or option (the message names it).
        ejkernel.ops.ConfigError: no installed implementation can serve the call (the message says why).

    Example:

    >>> import jax, jax.numpy as jnp
    >>> from ejkernel.modules import flash_attention
    >>> q = jax.random.normal(jax.random.key(0), (2, 128, 8, 64))
    >>> k = v = jax.random.normal(jax.random.key(1), (2, 128, 2, 64))  # GQA: 8 query heads, 2 kv heads
    >>> flash_attention(q, k, v, causal=True).shape
    (2, 128, 8, 64)
    """
    arrays = {
        "query": query,
        "key": key,
        "value": value,
        "bias": bias,
        "attention_mask": attention_mask,
        "q_segment_ids": q_segment_ids,
        "kv_segment_ids": kv_segment_ids,
        "dropout_seed": dropout_seed,
        "cu_seqlens_q": cu_seqlens_q,
        "cu_seqlens_k": cu_seqlens_k,
    }
    options = {
        "softmax_scale": softmax_scale,
        "causal": causal,
        "sliding_window": sliding_window,
        "logits_soft_cap": logits_soft_cap,
        "dropout_prob": dropout_prob,
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
