"""``native_sparse_attention``: the public function and its operations-layer ``Kernel``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jaxtyping import Array, Float, Int

from ejkernel.modules.operations._dispatch import dispatch
from ejkernel.modules.operations._empty import attention_zeros
from ejkernel.modules.operations.configs import NativeSparseAttentionConfig
from ejkernel.ops import Invocation, Kernel


class NativeSparseAttention(Kernel[NativeSparseAttentionConfig]):
    op_id = "native_sparse_attention"
    config_type = NativeSparseAttentionConfig

    def normalize(self, arguments: dict[str, Any]) -> dict[str, Any]:
        d = arguments["query"].shape[-1]
        arguments["softmax_scale"] = float(
            d**-0.5 if arguments["softmax_scale"] is None else arguments["softmax_scale"]
        )
        counts = arguments["block_counts"]
        if isinstance(counts, int | np.integer):
            # Counts of N or more use every slot: the same call as no counts.
            n = arguments["block_indices"].shape[-1]
            arguments["block_counts"] = None if counts >= n else int(counts)
        arguments["block_size"] = int(arguments["block_size"])
        arguments["window_size"] = int(arguments["window_size"])
        return arguments

    def make_inputs(self, inv: Invocation, seed: int = 0) -> dict[str, Any]:
        inputs = super().make_inputs(inv, seed)
        a = inv.arguments
        idx = a["block_indices"]
        if isinstance(idx, jax.ShapeDtypeStruct):
            # Each token selects its own block and random earlier ones, as a top-k selection would.
            b, t, kh, n = idx.shape
            s, bs = a["key"].shape[1], a["block_size"]
            rng = np.random.default_rng(seed)
            own = (np.clip(np.arange(t) + s - t, 0, s - 1) // bs)[None, :, None, None]
            chosen = (rng.random((b, t, kh, n)) * (own + 1)).astype(np.int64)
            chosen[..., 0] = own[..., 0]
            inputs["block_indices"] = jax.numpy.asarray(chosen, idx.dtype)
        counts = a.get("block_counts")
        if isinstance(counts, jax.ShapeDtypeStruct):
            inputs["block_counts"] = jax.numpy.full(counts.shape, a["block_indices"].shape[-1], counts.dtype)
        return inputs

    def empty_result(self, arguments: Mapping[str, Any]) -> Any:
        return attention_zeros(arguments)  # no batch or heads (validate refuses T == 0 and S == 0)


_kernel = NativeSparseAttention()


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
    platform: str | None = None,
    backend: str | None = None,
    cfg: NativeSparseAttentionConfig | None = None,
    mesh: jax.sharding.Mesh | None = None,
    in_specs: Any = None,
    out_specs: Any = None,
) -> Float[Array, "B T H Dv"]:
    """DeepSeek's native sparse attention: each query token attends the key blocks selected for it,
    optionally plus attention over mean-pooled blocks and a sliding window, mixed by gates.

    Shapes: B batch, T query length, S key length, H query heads, K key/value heads (H % K == 0; the
    heads of a group share their kv head's selection), D head dim, Dv value head dim, N selection
    slots, NB = ceil(S / block_size) key blocks. Positions are bottom-right aligned: query i sits at
    key position ``p(i) = i + S - T``.

    Args:
        query: ``[B, T, H, D]``.
        key: ``[B, S, K, D]``.
        value: ``[B, S, K, Dv]``.
        block_indices: ``[B, T, K, N]`` ints: the key blocks each token selects (a set: repeats count
            once; indices outside ``[0, NB)``, e.g. ``-1`` padding, are ignored). Not differentiable.
        block_counts: use only the first ``block_counts`` slots (an int, or ``[B, T, K]`` ints); None: all.
        g_slc: ``[B, T, H]`` gate of the selected branch (None: 1).
        g_cmp: ``[B, T, H]`` gate of the compressed branch; given, it enables the branch: attention over
            the per-block means of keys and values, a block seen once complete (``(n + 1) * block_size - 1 <= p(i)``).
        g_swa: ``[B, T, H]`` gate of the sliding branch (required exactly when ``window_size > 0``).
        block_size: keys per block.
        window_size: the sliding branch attends the ``window_size`` latest keys ``p(i) - window_size < j <= p(i)``.
        softmax_scale: scale of the scores, default ``D ** -0.5``.
        causal: keys after ``p(i)`` are masked in every branch (non-causal: the window is symmetric).
        platform: restrict to one kernel platform (``"xla"``, ...); default: any.
        backend: run for this backend (``"cpu"``, ``"gpu"``, ``"tpu"``); default: JAX's default device.
        cfg: a ``NativeSparseAttentionConfig`` that overrides the config chain (never cached).
        mesh, in_specs, out_specs: run under ``jax.shard_map``; ``in_specs`` has one spec per array passed.

    Returns:
        ``[B, T, H, Dv]`` in ``query.dtype``: ``g_slc * o_slc + g_cmp * o_cmp + g_swa * o_swa``. A branch
        with no admitted key for a row contributes zeros.

    Raises:
        ValueError, TypeError: a bad shape, dtype or option (the message names it).
        ejkernel.ops.ConfigError: no installed implementation can serve the call (the message says why).

    Example:

    >>> import jax, jax.numpy as jnp
    >>> from ejkernel.modules import native_sparse_attention
    >>> q = jax.random.normal(jax.random.key(0), (1, 128, 16, 32))
    >>> k = v = jax.random.normal(jax.random.key(1), (1, 128, 1, 32))
    >>> own = (jnp.arange(128) // 32)[None, :, None, None]  # every token: its own block and block 0
    >>> idx = jnp.concatenate([own, jnp.zeros_like(own)], axis=-1)
    >>> gate = jnp.full((1, 128, 16), 0.5)
    >>> native_sparse_attention(q, k, v, idx, block_size=32, g_slc=gate, g_swa=gate, window_size=16).shape
    (1, 128, 16, 32)
    """
    arrays = {
        "query": query,
        "key": key,
        "value": value,
        "block_indices": block_indices,
        "block_counts": block_counts,
        "g_slc": g_slc,
        "g_cmp": g_cmp,
        "g_swa": g_swa,
    }
    options = {
        "block_size": block_size,
        "window_size": window_size,
        "softmax_scale": softmax_scale,
        "causal": causal,
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
