"""The ``attention`` contract: dense multi-head attention that can return its attention weights.

Shapes: B batch, T query length, S key length, H query heads, K key/value heads (H % K == 0; query
head h reads kv head h // (H // K)), D query/key head dim, Dv value head dim.

The scores, masks, softmax and dropout are exactly those of ``flash_attention`` (see
``ejkernel.kernels.signatures.flash_attention``; the same ``attention_allowed`` mask and the same
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
"""

from __future__ import annotations

from typing import Any

from jaxtyping import Array, Bool, Float, Int

from ejkernel.kernels.params import BwdParams, FwdParams
from ejkernel.kernels.signatures import flash_attention as _flash


def attention(
    query: Float[Array, "B T H D"],
    key: Float[Array, "B S K D"],
    value: Float[Array, "B S K Dv"],
    bias: Float[Array, "#B #H T S"] | None = None,
    *,
    attention_mask: Bool[Array, "#B #H T S"] | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    dropout_prob: float = 0.0,
    dropout_seed: int | Int[Array, ""] | None = None,
    return_weights: bool = False,
    fwd_params: FwdParams | None = None,
    bwd_params: BwdParams | None = None,
) -> Float[Array, "B T H Dv"] | tuple[Float[Array, "B T H Dv"], Float[Array, "B H T S"]]:
    """Canonical signature of ``attention`` (see the module docstring for the semantics)."""
    raise NotImplementedError


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
        _flash.validate(
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
