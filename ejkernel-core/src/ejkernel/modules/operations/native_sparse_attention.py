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

The op is defined here once: this contract, ``validate``, the ``Kernel`` and the public function, whose
parameters are the canonical signature (``ejkernel.kernels.signatures.canonical_signature``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jaxtyping import Array, Float, Int

from ejkernel.kernels.signatures._checks import (
    ArrayIn,
    check_bool,
    check_float,
    check_query_key_value,
    check_scale,
    describe,
    is_count,
    is_int_array,
    shape,
)
from ejkernel.modules.operations._dispatch import dispatch
from ejkernel.modules.operations._empty import attention_zeros
from ejkernel.modules.operations._typecheck import checked
from ejkernel.modules.operations.configs import NativeSparseAttentionConfig
from ejkernel.ops import Invocation, Kernel

OP = "native_sparse_attention"


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


@checked
def native_sparse_attention(
    query: Float[ArrayIn, "B T H D"],
    key: Float[ArrayIn, "B S K D"],
    value: Float[ArrayIn, "B S K Dv"],
    block_indices: Int[ArrayIn, "B T K N"],
    *,
    block_counts: int | Int[ArrayIn, "B T K"] | None = None,
    g_slc: Float[ArrayIn, "B T H"] | None = None,
    g_cmp: Float[ArrayIn, "B T H"] | None = None,
    g_swa: Float[ArrayIn, "B T H"] | None = None,
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
