"""The ``ragged_decode_attention`` contract: one decode query per batch row over a dense key/value cache with ragged valid ranges.

Shapes: B batch rows, S cache length, H query heads, K key/value heads (H % K == 0; query head h reads
kv head h // (H // K)), D query/key head dim, Dv value head dim.

Semantics, for batch row ``b`` with ``lo = max(sequence_start[b], 0)`` and ``hi = min(sequence_end[b], S)``:

1. the keys ``lo <= j < hi`` of ``key[b]`` are valid; the query sits at position ``hi - 1`` (after the
   last valid key) and may attend every valid key; with ``sliding_window=W`` only ``hi - W <= j``
   (its last ``W`` positions, its own included);
2. ``s_j = softmax_scale * q . k_j`` (default ``D ** -0.5``); with ``logits_soft_cap``:
   ``s_j = cap * tanh(s_j / cap)``;
3. softmax over the admitted keys in float32, ``out = sum_j p_j v_j`` in the dtype of ``query``;
4. an empty range (``hi <= lo``) gives zeros (never NaN).

Keys and values outside ``[lo, hi)`` never change the output, whatever they hold, NaN included.
``query``, ``key`` and ``value`` share one float dtype, or the cache is float8 (``float8_e4m3fn`` or
``float8_e5m2``, both alike: a quantized cache, as serving engines keep it): key ``j`` is then
``k_scale * key[..j..]`` in float32 and its value ``v_scale * value[..j..]``, each scale a positive float
(per tensor) or a float array ``[K]`` (per kv head); None is 1, and scales apply to any cache dtype.

Not differentiable: differentiating a call raises ``TypeError`` (inputs under ``jax.lax.stop_gradient`` pass).

The op is defined here once: this contract, ``validate``, the ``Kernel`` and the public function, whose
parameters are the canonical signature (``ejkernel.kernels.signatures.canonical_signature``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Integer

from ejkernel.kernels.signatures._checks import ArrayIn, check_query_key_value, shape
from ejkernel.kernels.signatures._serving import (
    check_cache_scales,
    check_int,
    check_options,
    normalize_options,
    refuse_gradients,
)
from ejkernel.modules.operations._dispatch import dispatch
from ejkernel.modules.operations._empty import attention_zeros
from ejkernel.modules.operations._typecheck import checked
from ejkernel.modules.operations.configs import RaggedDecodeAttentionConfig
from ejkernel.ops import Invocation, Kernel

OP = "ragged_decode_attention"


def validate(
    query: Any,
    key: Any,
    value: Any,
    sequence_start: Any,
    sequence_end: Any,
    *,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    k_scale: Any = None,
    v_scale: Any = None,
    **_: Any,
) -> None:
    """Check a ``ragged_decode_attention`` call; raise an error naming the argument, what was expected and what came."""
    layouts = ("[B, H, D]", "[B, S, K, D]", "[B, S, K, Dv]")
    b = check_query_key_value(OP, query, key, value, layouts=layouts, quantized_kv=True)[0][0]
    check_int(OP, "sequence_start", sequence_start, (b,), "[B]")
    check_int(OP, "sequence_end", sequence_end, (b,), "[B]")
    check_options(OP, softmax_scale, logits_soft_cap, sliding_window)
    check_cache_scales(OP, shape(key)[2], k_scale=k_scale, v_scale=v_scale)


class RaggedDecodeAttention(Kernel[RaggedDecodeAttentionConfig]):
    op_id = "ragged_decode_attention"
    config_type = RaggedDecodeAttentionConfig

    def normalize(self, arguments: dict[str, Any]) -> dict[str, Any]:
        return normalize_options(arguments, arguments["query"].shape[-1])

    def make_inputs(self, inv: Invocation, seed: int = 0) -> dict[str, Any]:
        inputs = super().make_inputs(inv, seed)
        b = inv.arguments["query"].shape[0]
        s = inv.arguments["key"].shape[1]
        # Ranges from the start, half to all of the cache long: representative work.
        ends = np.linspace(s // 2, s, b).astype(np.int64)
        inputs["sequence_start"] = jnp.zeros((b,), inv.arguments["sequence_start"].dtype)
        inputs["sequence_end"] = jnp.asarray(ends, inv.arguments["sequence_end"].dtype)
        return inputs

    def empty_result(self, arguments: Mapping[str, Any]) -> Any:
        return attention_zeros(arguments)  # no rows (B == 0), or no cache (S == 0): every range is empty


_kernel = RaggedDecodeAttention()


@checked
def ragged_decode_attention(
    query: Float[ArrayIn, "B H D"],
    key: Float[ArrayIn, "B S K D"],
    value: Float[ArrayIn, "B S K Dv"],
    sequence_start: Integer[ArrayIn, "B"],
    sequence_end: Integer[ArrayIn, "B"],
    *,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    k_scale: float | np.floating | Float[ArrayIn, ""] | Float[ArrayIn, "K"] | None = None,
    v_scale: float | np.floating | Float[ArrayIn, ""] | Float[ArrayIn, "K"] | None = None,
    platform: str | None = None,
    backend: str | None = None,
    cfg: RaggedDecodeAttentionConfig | None = None,
    mesh: jax.sharding.Mesh | None = None,
    in_specs: Any = None,
    out_specs: Any = None,
) -> Float[Array, "B H Dv"]:
    """Decode attention over a dense key/value cache in which every batch row has its own valid range.

    Shapes: B batch rows, S cache length, H query heads, K key/value heads (H % K == 0: GQA, MQA when
    K == 1), D head dim, Dv value head dim.

    Args:
        query: ``[B, H, D]``, one query per row, at position ``sequence_end - 1``.
        key: ``[B, S, K, D]``.
        value: ``[B, S, K, Dv]``.
        sequence_start: ``[B]`` ints, the first valid key of every row.
        sequence_end: ``[B]`` ints, one past the last valid key (``<= start``: no key, zeros).
        softmax_scale: scale of the scores, default ``D ** -0.5``.
        logits_soft_cap: ``cap * tanh(scores / cap)``.
        sliding_window: ``W``: attend only the last ``W`` positions (``end - W <= j < end``).
        k_scale: the keys' dequantization scale: a positive float, or a float array ``[K]`` (per kv head); the
            key is ``k_scale * key`` in float32 (a float8 cache). Default 1.
        v_scale: the values' scale, likewise.
        platform: restrict to one kernel platform (``"xla"``, ``"pallas"``, ...); default: any.
        backend: run for this backend (``"cpu"``, ``"gpu"``, ``"tpu"``); default: JAX's default device.
        cfg: a ``RaggedDecodeAttentionConfig`` that overrides the config chain (never cached).
        mesh, in_specs, out_specs: run under ``jax.shard_map``; ``in_specs`` has one spec per array passed.

    Returns:
        ``[B, H, Dv]`` in ``query.dtype``. Keys outside a row's range never change its output.

    Raises:
        ValueError, TypeError: a bad shape, dtype or option (the message names it); ``TypeError`` when
            differentiated (the op is not differentiable; ``jax.lax.stop_gradient`` its inputs).
        ejkernel.ops.ConfigError: no installed implementation can serve the call (the message says why).

    Example:

    >>> import jax, jax.numpy as jnp
    >>> from ejkernel.modules import ragged_decode_attention
    >>> q = jax.random.normal(jax.random.key(0), (3, 8, 64))
    >>> k = v = jax.random.normal(jax.random.key(1), (3, 128, 2, 64))  # GQA: 8 query heads, 2 kv heads
    >>> out = ragged_decode_attention(q, k, v, jnp.array([0, 40, 7]), jnp.array([128, 90, 7]))
    >>> out.shape, bool(jnp.all(out[2] == 0))  # the third row's range is empty
    ((3, 8, 64), True)
    """
    query, key, value = refuse_gradients("ragged_decode_attention", query, key, value)
    arrays: dict[str, Any] = {
        "query": query,
        "key": key,
        "value": value,
        "sequence_start": sequence_start,
        "sequence_end": sequence_end,
    }
    options: dict[str, Any] = {
        "softmax_scale": softmax_scale,
        "logits_soft_cap": logits_soft_cap,
        "sliding_window": sliding_window,
    }
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):  # an array scale is traced, a float static
        (arrays if hasattr(x, "dtype") else options)[name] = x
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
