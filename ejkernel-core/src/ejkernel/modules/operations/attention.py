"""The ``attention`` contract: dense multi-head attention that can return its attention weights.

Shapes: B batch, T query length, S key length, H query heads, K key/value heads (H % K == 0; query
head h reads kv head h // (H // K)), D query/key head dim, Dv value head dim.

The scores, masks, softmax and dropout are exactly those of ``flash_attention`` (see
``ejkernel.modules.operations.flash_attention``; the same ``attention_allowed`` mask and the same
``dropout_keep`` survivors, so both ops agree entry for entry), without packing (no segment ids, no
``cu_seqlens``):

1. ``s = softmax_scale * q_i . k_j`` (``softmax_scale`` defaults to ``D ** -0.5``);
2. ``s += bias`` (broadcast over batch and heads);
3. ``s = logits_soft_cap * tanh(s / logits_soft_cap)``;
4. the key is masked out unless ``attention_mask[b, h, i, j]`` (when given) and ``causal``:
   ``j <= i + S - T`` (bottom-right aligned, as FlashAttention 2), ``sliding_window=(left, right)``:
   ``i + S - T - left <= j <= i + S - T + right`` (an int ``w`` means ``(w, w)``);
5. ``P = softmax`` over the admitted keys in float32; a row with no admitted key has ``P = 0``;
6. dropout: ``P[b, h, i, j]`` survives when ``dropout_keep(seed, b, h, i, j, H, p)``, scaled by
   ``1 / (1 - p)``; the others become 0;
7. ``out = P @ v`` in the dtype of ``query`` (a row with no admitted key gives zeros, never NaN).

With ``return_weights`` the result is ``(out, weights)``: ``weights [B, H, T, S]`` is the matrix ``P``
of step 7, the one that multiplies ``value`` (after dropout), in **float32** whatever the input dtype
(the softmax is computed in float32, and rounding probabilities to bfloat16 would lose what one
inspects weights for). Both results are differentiable in query, key, value and bias.

The op is defined here once: this contract, ``validate``, the ``Kernel`` and the public function, whose
parameters are the canonical signature (``ejkernel.kernels.signatures.canonical_signature``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ejkernel.kernels.signatures._attention import rows_broadcast
from ejkernel.kernels.signatures._checks import ArrayIn
from ejkernel.modules.operations._dispatch import dispatch
from ejkernel.modules.operations._empty import attention_zeros
from ejkernel.modules.operations._typecheck import checked
from ejkernel.modules.operations.configs import AttentionConfig
from ejkernel.modules.operations.flash_attention import _kernel as _flash_kernel
from ejkernel.modules.operations.flash_attention import validate as validate_flash_attention
from ejkernel.ops import Kernel


def validate(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    *,
    attention_mask: Any = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    dropout_prob: float = 0.0,
    dropout_seed: Any = None,
    return_weights: bool = False,
    **_: Any,
) -> None:
    """Check an ``attention`` call: ``flash_attention``'s checks of the arguments both ops share, and ``return_weights``."""
    try:
        validate_flash_attention(
            query,
            key,
            value,
            bias,
            attention_mask=attention_mask,
            softmax_scale=softmax_scale,
            causal=causal,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            dropout_prob=dropout_prob,
            dropout_seed=dropout_seed,
        )
    except (ValueError, TypeError) as e:
        raise type(e)("attention: " + str(e).removeprefix("flash_attention: ")) from None
    if not isinstance(return_weights, bool):
        raise TypeError(f"attention: return_weights must be a bool, got {type(return_weights).__name__}")


class Attention(Kernel[AttentionConfig]):
    op_id = "attention"
    config_type = AttentionConfig

    def normalize(self, arguments: dict[str, Any]) -> dict[str, Any]:
        # The options both ops share have the same canonical forms (window pair, float scale, no seed
        # without dropout); flash_attention's normalize touches only those.
        arguments = _flash_kernel.normalize(arguments)
        arguments["return_weights"] = bool(arguments["return_weights"])
        return arguments

    def empty_result(self, arguments: Mapping[str, Any]) -> Any:
        out = attention_zeros(arguments)  # no queries, or no keys: rows that admit no key give zeros
        if out is None or not arguments["return_weights"]:
            return out
        (b, t, h, _), s = out.shape, arguments["key"].shape[1]
        return out, jnp.zeros((b, h, t, s), jnp.float32)  # the weights are float32 whatever the inputs


_kernel = Attention()


@checked
def attention(
    query: Float[ArrayIn, "B T H D"],
    key: Float[ArrayIn, "B S K D"],
    value: Float[ArrayIn, "B S K Dv"],
    bias: Float[ArrayIn, "#B #H #T S"] | None = None,
    *,
    attention_mask: Bool[ArrayIn, "#B #H #T S"] | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    dropout_prob: float = 0.0,
    dropout_seed: int | Int[ArrayIn, ""] | None = None,
    return_weights: bool = False,
    platform: str | None = None,
    backend: str | None = None,
    cfg: AttentionConfig | None = None,
    mesh: jax.sharding.Mesh | None = None,
    in_specs: Any = None,
    out_specs: Any = None,
) -> Float[Array, "B T H Dv"] | tuple[Float[Array, "B T H Dv"], Float[Array, "B H T S"]]:
    """Dense multi-head attention ``softmax(scale * q k^T + bias) v`` that can return its attention weights.

    The same scores, masks and dropout as ``flash_attention`` (entry for entry), computed densely:
    use it when you want the weights; ``flash_attention`` is the O(T)-memory op for the output alone.

    Shapes: B batch, T query length, S key length, H query heads, K key/value heads (H % K == 0:
    GQA, MQA when K == 1), D head dim, Dv value head dim.

    Args:
        query: ``[B, T, H, D]``.
        key: ``[B, S, K, D]``.
        value: ``[B, S, K, Dv]``.
        bias: added to the scaled scores, broadcastable ``[B|1, H|1, T|1, S]``; differentiable.
        attention_mask: boolean ``[B|1, H|1, T|1, S]``, True where a query may attend a key (``T`` = 1: a
            key-padding mask, the same for every query row).
        softmax_scale: scale of the scores, default ``D ** -0.5``.
        causal: query i attends keys ``j <= i + S - T`` (bottom-right aligned, as FlashAttention 2).
        sliding_window: ``(left, right)`` keys around the aligned diagonal, or ``w`` for ``(w, w)``.
        logits_soft_cap: ``cap * tanh(scores / cap)`` before masking.
        dropout_prob, dropout_seed: attention dropout, the same survivors as ``flash_attention`` for a seed
            (without one, the seed is derived from the query's values, as ``flash_attention`` does).
        return_weights: also return the attention weights.
        platform: restrict to one kernel platform (``"xla"``, ...); default: any.
        backend: run for this backend (``"cpu"``, ``"gpu"``, ``"tpu"``); default: JAX's default device.
        cfg: an ``AttentionConfig`` that overrides the config chain (never cached).
        mesh, in_specs, out_specs: run under ``jax.shard_map``; ``in_specs`` has one spec per array passed.

    Returns:
        ``out [B, T, H, Dv]`` in ``query.dtype``; with ``return_weights``, ``(out, weights)`` where
        ``weights [B, H, T, S]`` is the float32 matrix that multiplies ``value`` (softmax probabilities
        after dropout; zero on masked keys). A query row with no admitted key gives zeros (weights and output).

    Raises:
        ValueError, TypeError: a bad shape, dtype or option (the message names it).
        ejkernel.ops.ConfigError: no installed implementation can serve the call (the message says why).

    Example:

    >>> import jax, jax.numpy as jnp
    >>> from ejkernel.modules import attention
    >>> q = jax.random.normal(jax.random.key(0), (2, 16, 4, 32))
    >>> k = v = jax.random.normal(jax.random.key(1), (2, 16, 2, 32))  # GQA: 4 query heads, 2 kv heads
    >>> out, weights = attention(q, k, v, causal=True, return_weights=True)
    >>> out.shape, weights.shape, weights.dtype
    ((2, 16, 4, 32), (2, 4, 16, 16), dtype('float32'))
    >>> bool(jnp.allclose(weights.sum(-1), 1.0, atol=1e-5)), float(weights[0, 0, 0, 1])  # causal: row 0 sees key 0
    (True, 0.0)
    """
    # A key-padding mask or bias [B|1, H|1, 1, S] applies to every query row (as in flash_attention).
    bias, attention_mask = (rows_broadcast(x, query, key) for x in (bias, attention_mask))
    arrays = {
        "query": query,
        "key": key,
        "value": value,
        "bias": bias,
        "attention_mask": attention_mask,
        "dropout_seed": dropout_seed,
    }
    options = {
        "softmax_scale": softmax_scale,
        "causal": causal,
        "sliding_window": sliding_window,
        "logits_soft_cap": logits_soft_cap,
        "dropout_prob": dropout_prob,
        "return_weights": return_weights,
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
