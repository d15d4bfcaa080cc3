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
``query``, ``key`` and ``value`` share one float dtype.

Not differentiable: differentiating a call raises ``TypeError`` (inputs under ``jax.lax.stop_gradient`` pass).
"""

from __future__ import annotations

from typing import Any

from jaxtyping import Array, Float, Int

from ejkernel.kernels.params import BwdParams, FwdParams
from ejkernel.kernels.signatures._checks import check_query_key_value
from ejkernel.kernels.signatures._serving import check_int, check_options
from ejkernel.kernels.signatures._serving import refuse_gradients as refuse_gradients  # for implementations

OP = "ragged_decode_attention"


def ragged_decode_attention(
    query: Float[Array, "B H D"],
    key: Float[Array, "B S K D"],
    value: Float[Array, "B S K Dv"],
    sequence_start: Int[Array, "B"],
    sequence_end: Int[Array, "B"],
    *,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    fwd_params: FwdParams | None = None,
    bwd_params: BwdParams | None = None,
) -> Float[Array, "B H Dv"]:
    """Canonical signature of ``ragged_decode_attention`` (see the module docstring for the semantics)."""
    raise NotImplementedError


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
    **_: Any,
) -> None:
    """Check a ``ragged_decode_attention`` call; raise an error naming the argument, what was expected and what came."""
    b = check_query_key_value(OP, query, key, value, layouts=("[B, H, D]", "[B, S, K, D]", "[B, S, K, Dv]"))[0][0]
    check_int(OP, "sequence_start", sequence_start, (b,), "[B]")
    check_int(OP, "sequence_end", sequence_end, (b,), "[B]")
    check_options(OP, softmax_scale, logits_soft_cap, sliding_window)
