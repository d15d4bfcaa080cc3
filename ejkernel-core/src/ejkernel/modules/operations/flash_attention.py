"""The ``flash_attention`` contract.

Shapes: B batch, T query length, S key length, H query heads, K key/value heads (H % K == 0;
query head h reads kv head h // (H // K)), D query/key head dim, Dv value head dim, N packed sequences.

Semantics, in the order they apply to the scores of query i and key j:

1. ``s = softmax_scale * q_i . k_j`` (``softmax_scale`` defaults to ``D ** -0.5``);
2. ``s += bias`` (broadcast over batch and heads);
3. ``s = logits_soft_cap * tanh(s / logits_soft_cap)``;
4. the key is masked out unless every given mask admits it: ``attention_mask[b, h, i, j]``;
   equal segment ids; ``causal``: ``j <= i + S - T`` (bottom-right aligned, as FlashAttention 2);
   ``sliding_window=(left, right)``: ``i + S - T - left <= j <= i + S - T + right`` (an int ``w``
   means ``(w, w)``); with ``cu_seqlens_q``/``cu_seqlens_k`` (B == 1) the sequences are packed
   along T and S, keys attend only within their own sequence, and causal/window alignment is per
   sequence (``cu_seqlens_q`` non-decreasing within ``[0, T]``, ``cu_seqlens_k`` within ``[0, S]``: checked
   when concrete; under ``jit`` unchecked unless ``EJKERNEL_CHECKS=1``, and a violation gives a wrong
   output without an error); ``kv_lengths[b]``: ``j < kv_lengths[b]``; ``prefix_lengths[b]`` (prefix-LM,
   with ``causal``): ``j < prefix_lengths[b]`` is admitted whatever the causal rule says (the window still
   applies). Lengths are within ``[0, S]`` (checked as ``cu_seqlens`` are). A ``MaskInfo`` passed as
   ``attention_mask`` is these rules, folded into the arguments above (``mask_info.merge_mask_info``);
5. softmax over the admitted keys in float32; a row with no admitted key gives zeros (never NaN);
6. dropout: probability ``p`` is dropped and survivors are scaled by ``1 / (1 - p)``; whether
   ``(b, h, i, j)`` survives is ``dropout_keep(seed, b, h, i, j, H, p)`` (in ``ejkernel.kernels.signatures._attention``),
   so every backend drops exactly the same entries and the forward and backward agree. Without ``dropout_seed`` the seed
   is ``seed_from_query``: a hash of the query's values, so the mask changes whenever the query
   does (every training step, every layer) and is the same for identical inputs;
7. ``out = P @ v`` in the dtype of ``query``.

The op is defined here once: this contract, ``validate``, the ``Kernel`` and the public function, whose
parameters are the canonical signature (``ejkernel.kernels.signatures.canonical_signature``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from ejkernel.kernels.signatures._attention import normalize_window, rows_broadcast, seed_from_query
from ejkernel.kernels.signatures._checks import (
    ArrayIn,
    check_bool,
    check_cu_seqlens,
    check_float,
    check_lengths,
    check_query_key_value,
    check_scale,
    check_segment_ids,
    check_soft_cap,
    check_window,
    describe,
    dtype_name,
    is_int_array,
    shape,
)
from ejkernel.modules.operations._dispatch import dispatch
from ejkernel.modules.operations._empty import attention_zeros
from ejkernel.modules.operations._typecheck import checked
from ejkernel.modules.operations.configs import FlashAttentionConfig
from ejkernel.modules.operations.mask_info import MaskInfo, merge_mask_info
from ejkernel.ops import Invocation, Kernel

OP = "flash_attention"


def _check_broadcastable(name: str, x: Any, full: tuple[int, int, int, int]) -> None:
    got = shape(x)
    if len(got) != 4 or any(g not in (1, f) for g, f in zip(got[:2], full[:2])) or got[2:] != full[2:]:
        raise ValueError(
            f"{OP}: {name} must have shape [B|1, H|1, T|1, S] = [{full[0]}|1, {full[1]}|1, {full[2]}|1, {full[3]}], "
            f"got {list(got)}"
        )


def validate(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    *,
    attention_mask: Any = None,
    q_segment_ids: Any = None,
    kv_segment_ids: Any = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    dropout_prob: float = 0.0,
    dropout_seed: Any = None,
    cu_seqlens_q: Any = None,
    cu_seqlens_k: Any = None,
    kv_lengths: Any = None,
    prefix_lengths: Any = None,
    **_: Any,
) -> None:
    """Check a ``flash_attention`` call; raise an error naming the argument, what was expected and what came."""
    q, k = check_query_key_value(OP, query, key, value)
    b, t, h, s = q[0], q[1], q[2], k[1]
    if bias is not None:
        _check_broadcastable("bias", bias, (b, h, t, s))
        check_float(OP, "bias", bias)
    if attention_mask is not None:
        _check_broadcastable("attention_mask", attention_mask, (b, h, t, s))
        if dtype_name(attention_mask) != "bool":
            raise TypeError(f"{OP}: attention_mask must be bool (True = attend), got {dtype_name(attention_mask)}")
    check_segment_ids(OP, q_segment_ids, kv_segment_ids, b, t, s)
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError(f"{OP}: pass both cu_seqlens_q and cu_seqlens_k, or neither")
    if cu_seqlens_q is not None:
        if q_segment_ids is not None:
            raise ValueError(
                f"{OP}: cu_seqlens_q/cu_seqlens_k and q_segment_ids/kv_segment_ids both pack sequences; pass one"
            )
        n = check_cu_seqlens(OP, "cu_seqlens_q", cu_seqlens_q, b, t)
        if check_cu_seqlens(OP, "cu_seqlens_k", cu_seqlens_k, b, s, "S") != n:
            raise ValueError(
                f"{OP}: cu_seqlens_q and cu_seqlens_k must have the same length, "
                f"got {n + 1} and {shape(cu_seqlens_k)[0]}"
            )
    for name, lengths in (("kv_lengths", kv_lengths), ("prefix_lengths", prefix_lengths)):
        if lengths is not None:
            if cu_seqlens_q is not None:
                raise ValueError(
                    f"{OP}: {name} is per batch row; with cu_seqlens_q/cu_seqlens_k the sequences' "
                    "lengths are their offsets, pass one or the other"
                )
            check_lengths(OP, name, lengths, b, s)
    check_bool(OP, "causal", causal)
    if prefix_lengths is not None and not causal:
        raise ValueError(
            f"{OP}: prefix_lengths needs causal=True (prefix-LM: the prefix is seen by every row, the rest causally)"
        )
    check_scale(OP, "softmax_scale", softmax_scale)
    check_window(OP, "sliding_window", sliding_window)
    check_soft_cap(OP, logits_soft_cap)
    if not (isinstance(dropout_prob, int | float) and 0.0 <= dropout_prob < 1.0):
        raise ValueError(f"{OP}: dropout_prob must be a float in [0, 1), got {dropout_prob!r}")
    if (
        dropout_seed is not None
        and not isinstance(dropout_seed, int)
        and (shape(dropout_seed) != () or not is_int_array(dropout_seed))
    ):
        raise TypeError(f"{OP}: dropout_seed must be an int or a scalar integer array, got {describe(dropout_seed)}")


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


@checked
def flash_attention(
    query: Float[ArrayIn, "B T H D"],
    key: Float[ArrayIn, "B S K D"],
    value: Float[ArrayIn, "B S K Dv"],
    bias: Float[ArrayIn, "#B #H #T S"] | None = None,
    *,
    attention_mask: Bool[ArrayIn, "#B #H #T S"] | MaskInfo | None = None,
    q_segment_ids: Int[ArrayIn, "B T"] | None = None,
    kv_segment_ids: Int[ArrayIn, "B S"] | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    dropout_prob: float = 0.0,
    dropout_seed: int | Int[ArrayIn, ""] | None = None,
    cu_seqlens_q: Int[ArrayIn, "N1"] | None = None,
    cu_seqlens_k: Int[ArrayIn, "N1"] | None = None,
    kv_lengths: Int[ArrayIn, "B"] | None = None,
    prefix_lengths: Int[ArrayIn, "B"] | None = None,
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
        bias: added to the scaled scores, broadcastable ``[B|1, H|1, T|1, S]``; differentiable.
        attention_mask: boolean ``[B|1, H|1, T|1, S]``, True where a query may attend a key (``T`` = 1: a
            key-padding mask, the same for every query row); or a :class:`~ejkernel.modules.MaskInfo`, the
            rules below as one object, which kernels turn into block skipping without a dense mask.
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
        kv_lengths: ``[B]`` ints; sequence ``b`` attends keys ``j < kv_lengths[b]`` (right padding).
        prefix_lengths: ``[B]`` ints, prefix-LM (needs ``causal``): keys ``j < prefix_lengths[b]`` are seen
            by every query of sequence ``b``.
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
    if isinstance(attention_mask, MaskInfo):
        rules = merge_mask_info(
            attention_mask,
            {
                "causal": causal,
                "sliding_window": sliding_window,
                "q_segment_ids": q_segment_ids,
                "kv_segment_ids": kv_segment_ids,
                "kv_lengths": kv_lengths,
                "prefix_lengths": prefix_lengths,
            },
            OP,
        )
        attention_mask, causal, sliding_window = None, rules["causal"], rules["sliding_window"]
        q_segment_ids, kv_segment_ids = rules["q_segment_ids"], rules["kv_segment_ids"]
        kv_lengths, prefix_lengths = rules["kv_lengths"], rules["prefix_lengths"]
    # A key-padding mask or bias ``[B|1, H|1, 1, S]`` (as Flax and jax.nn take it) applies to every query row.
    bias, attention_mask = (rows_broadcast(x, query, key) for x in (bias, attention_mask))
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
        "kv_lengths": kv_lengths,
        "prefix_lengths": prefix_lengths,
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
