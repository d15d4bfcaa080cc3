"""The ``scaled_dot_product_attention`` contract: the semantics of ``jax.nn.dot_product_attention``.

Shapes (the letters of ``jax.nn.dot_product_attention``): B batch, T query length, S key length,
N query heads, K key/value heads (N % K == 0: GQA, MQA when K == 1; query head n reads kv head
n // (N // K)), H query/key head dim, Hv value head dim.

For query ``i`` and key ``j`` of batch ``b`` and head ``n``:

1. ``s = scale * q_i . k_j`` in float32 (``scale`` defaults to ``H ** -0.5``);
2. ``s += bias[b, n, i, j]``; ``bias`` is 4-D and broadcasts along every axis of size 1
   (``[B|1, N|1, T|1, S|1]``);
3. the key is admitted when all of these hold (the others are masked out):
   ``mask[b, n, i, j]`` (boolean, True = attend, broadcast like ``bias``);
   ``is_causal``: ``j <= i`` (top-left aligned: query i and key i share a position, also when T != S);
   ``local_window_size=(left, right)``: ``i - left <= j <= i + right`` (top-left aligned; an int
   ``w`` means ``(w, w)``);
   ``query_seq_lengths``: ``i < query_seq_lengths[b]``; ``key_value_seq_lengths``: ``j < key_value_seq_lengths[b]``;
4. softmax over the admitted keys, in float32;
5. ``out = P @ v`` in the dtype of ``query``.

A query row with no admitted key gives zeros, never NaN. This is where ejkernel departs from
``jax.nn.dot_product_attention(implementation="xla")``: jax gives such a row a uniform softmax over
all ``S`` keys, i.e. the mean of the values (except for rows past ``query_seq_lengths``, which jax
sets to zero too). Rows without keys arise from a ``mask`` row of False, a key/value sequence length
of 0, or a window when ``T > S`` (query ``i`` sees nothing once ``i - left > S - 1``). Everything else
agrees with jax: on rows with at least one admitted key both compute the same function.

Beyond jax: ``value`` may have its own head dim ``Hv`` (jax requires ``Hv == H``); the inputs must be
4-D (jax also takes 3-D ones without the batch axis).

The op is defined here once: this contract, ``validate``, the ``Kernel`` and the public function, whose
parameters are the canonical signature (``ejkernel.kernels.signatures.canonical_signature``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from ejkernel.kernels.signatures._attention import normalize_window
from ejkernel.kernels.signatures._checks import (
    ArrayIn,
    check_bool,
    check_float,
    check_query_key_value,
    check_window,
    describe,
    dtype_name,
    is_int_array,
    shape,
)
from ejkernel.modules.operations._dispatch import dispatch
from ejkernel.modules.operations._empty import attention_zeros
from ejkernel.modules.operations._typecheck import checked
from ejkernel.modules.operations.configs import ScaledDotProductAttentionConfig
from ejkernel.ops import Invocation, Kernel

_OP = "scaled_dot_product_attention"


def _check_broadcastable(name: str, x: Any, full: tuple[int, int, int, int]) -> None:
    got = shape(x)
    if len(got) != 4 or any(g not in (1, f) for g, f in zip(got, full)):
        want = ", ".join(f"{f}|1" for f in full)
        raise ValueError(f"{_OP}: {name} must be 4-D, broadcastable to [B, N, T, S]: [{want}], got {list(got)}")


def validate(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: Any = None,
    key_value_seq_lengths: Any = None,
    local_window_size: int | tuple[int, int] | None = None,
    **_: Any,
) -> None:
    """Check a ``scaled_dot_product_attention`` call; raise an error naming the argument, what was expected and what came."""
    q, k = check_query_key_value(_OP, query, key, value, layouts=("[B, T, N, H]", "[B, S, K, H]", "[B, S, K, Hv]"))
    b, t, n, s = q[0], q[1], q[2], k[1]
    if bias is not None:
        _check_broadcastable("bias", bias, (b, n, t, s))
        check_float(_OP, "bias", bias)
    if mask is not None:
        _check_broadcastable("mask", mask, (b, n, t, s))
        if dtype_name(mask) != "bool":
            raise TypeError(
                f"{_OP}: mask must be bool (True = attend; pass an additive mask as bias), got {dtype_name(mask)}"
            )
    for name, x in (("query_seq_lengths", query_seq_lengths), ("key_value_seq_lengths", key_value_seq_lengths)):
        if x is not None and (shape(x) != (b,) or not is_int_array(x)):
            raise ValueError(f"{_OP}: {name} must be an integer array of shape [B] = [{b}], got {describe(x)}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, int | float | np.integer | np.floating)):
        raise TypeError(f"{_OP}: scale must be a Python float (or a NumPy scalar) or None, got {type(scale).__name__}")
    check_bool(_OP, "is_causal", is_causal)
    check_window(_OP, "local_window_size", local_window_size)


class ScaledDotProductAttention(Kernel[ScaledDotProductAttentionConfig]):
    op_id = "scaled_dot_product_attention"
    config_type = ScaledDotProductAttentionConfig

    def normalize(self, arguments: dict[str, Any]) -> dict[str, Any]:
        h = arguments["query"].shape[-1]
        arguments["scale"] = float(h**-0.5 if arguments["scale"] is None else arguments["scale"])
        window = normalize_window(arguments["local_window_size"])
        if window is not None and arguments["is_causal"]:
            window = (window[0], 0)  # causal admits no key right of the diagonal anyway
        arguments["local_window_size"] = window
        return arguments

    def make_inputs(self, inv: Invocation, seed: int = 0) -> dict[str, Any]:
        inputs = super().make_inputs(inv, seed)
        # Full sequences (the default zeros would leave no valid query or key): representative work for timing.
        for name, axis in (("query_seq_lengths", "query"), ("key_value_seq_lengths", "key")):
            x = inv.arguments.get(name)
            if isinstance(x, jax.ShapeDtypeStruct):
                inputs[name] = jax.numpy.full(x.shape, inv.arguments[axis].shape[1], x.dtype)
        return inputs

    def empty_result(self, arguments: Mapping[str, Any]) -> Any:
        return attention_zeros(arguments)  # no queries, or no keys: rows that admit no key give zeros


_kernel = ScaledDotProductAttention()


@checked
def scaled_dot_product_attention(
    query: Float[ArrayIn, "B T N H"],
    key: Float[ArrayIn, "B S K H"],
    value: Float[ArrayIn, "B S K Hv"],
    bias: Float[ArrayIn, "#B #N #T #S"] | None = None,
    mask: Bool[ArrayIn, "#B #N #T #S"] | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: Int[ArrayIn, "B"] | None = None,
    key_value_seq_lengths: Int[ArrayIn, "B"] | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    platform: str | None = None,
    backend: str | None = None,
    cfg: ScaledDotProductAttentionConfig | None = None,
    mesh: jax.sharding.Mesh | None = None,
    in_specs: Any = None,
    out_specs: Any = None,
) -> Float[Array, "B T N Hv"]:
    """Scaled dot-product attention with the semantics of ``jax.nn.dot_product_attention``, on ejkernel's kernels.

    A drop-in for ``jax.nn.dot_product_attention`` (same arguments, same top-left causal and window
    alignment, same masks), except that a query row with no admitted key gives zeros where jax gives
    the mean of all values (see ``ejkernel.modules.operations.scaled_dot_product_attention``).

    Shapes (jax's letters): B batch, T query length, S key length, N query heads, K key/value heads
    (N % K == 0: GQA, MQA when K == 1), H head dim, Hv value head dim.

    Args:
        query: ``[B, T, N, H]``.
        key: ``[B, S, K, H]``.
        value: ``[B, S, K, Hv]``.
        bias: added to the scaled logits; 4-D, broadcastable to ``[B, N, T, S]``; differentiable.
        mask: boolean, 4-D, broadcastable to ``[B, N, T, S]``; True where a query may attend a key.
        scale: scale of the logits, default ``H ** -0.5``.
        is_causal: query i attends keys ``j <= i`` (top-left aligned, as jax).
        query_seq_lengths: ``[B]`` ints; query rows ``i >= query_seq_lengths[b]`` are padding (zeros).
        key_value_seq_lengths: ``[B]`` ints; keys ``j >= key_value_seq_lengths[b]`` are padding.
        local_window_size: ``(left, right)``: query i attends keys ``i - left <= j <= i + right``; ``w`` means ``(w, w)``.
        platform: restrict to one kernel platform (``"xla"``, ...); default: any.
        backend: run for this backend (``"cpu"``, ``"gpu"``, ``"tpu"``); default: JAX's default device.
        cfg: a ``ScaledDotProductAttentionConfig`` that overrides the config chain (never cached).
        mesh, in_specs, out_specs: run under ``jax.shard_map``; ``in_specs`` has one spec per array passed.

    Returns:
        ``[B, T, N, Hv]`` in ``query.dtype``. A query row with no admitted key gives zeros.

    Raises:
        ValueError, TypeError: a bad shape, dtype or option (the message names it).
        ejkernel.ops.ConfigError: no installed implementation can serve the call (the message says why).

    Example:

    >>> import jax, jax.numpy as jnp
    >>> from ejkernel.modules import scaled_dot_product_attention
    >>> q = jax.random.normal(jax.random.key(0), (2, 24, 8, 32))
    >>> k = v = jax.random.normal(jax.random.key(1), (2, 40, 2, 32))  # GQA: 8 query heads, 2 kv heads
    >>> lengths = jnp.array([40, 25], jnp.int32)
    >>> out = scaled_dot_product_attention(q, k, v, is_causal=True, key_value_seq_lengths=lengths)
    >>> want = jax.nn.dot_product_attention(q, k, v, is_causal=True, key_value_seq_lengths=lengths)
    >>> out.shape, bool(jnp.allclose(out, want, atol=1e-5))
    ((2, 24, 8, 32), True)
    """
    arrays = {
        "query": query,
        "key": key,
        "value": value,
        "bias": bias,
        "mask": mask,
        "query_seq_lengths": query_seq_lengths,
        "key_value_seq_lengths": key_value_seq_lengths,
    }
    options = {"scale": scale, "is_causal": is_causal, "local_window_size": local_window_size}
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
