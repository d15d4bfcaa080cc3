"""What the three serving contracts share: checks of integer arrays and options, and the refusal to differentiate.

``page_attention``, ``ragged_page_attention`` and ``ragged_decode_attention`` read a key/value
cache at inference time. They agree on:

- ``softmax_scale`` (default ``D ** -0.5``) and ``logits_soft_cap`` (``cap * tanh(s / cap)`` after scaling);
- ``sliding_window=W`` (an int >= 1): the query at absolute position ``p`` sees the keys ``j`` with
  ``p - W < j <= p``, i.e. the last ``W`` positions including its own (as ``sliding_window`` of
  ``jax.experimental.pallas.ops.tpu.ragged_paged_attention``; ``flash_attention``'s ``(W - 1, 0)``);
- GQA: ``H % K == 0`` and query head ``h`` reads kv head ``h // (H // K)``;
- a query that admits no key gives zeros; cache entries a query may not read never change its output,
  whatever they hold (NaN included);
- they are not differentiable: differentiating a call raises a ``TypeError`` (see ``refuse_gradients``).

``page_attention`` and ``ragged_decode_attention`` also read a float8 cache (``float8_e4m3fn`` or ``float8_e5m2``,
key and value alike, the query in float32/bfloat16/float16): the key is ``k_scale * key_cache`` and the value
``v_scale * value_cache`` (float32), each scale a positive Python float (per tensor) or a float array ``[K]`` (per
kv head) or ``[]``; None is 1. Scales apply to any cache dtype. Implementations fold them out of the loop over keys
(``fold_cache_scales``): the key scale into the scores' scale or the query, the value scale into the output.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.kernels.signatures._checks import (
    FLOAT_DTYPES,
    check_query_key_value,
    check_scale,
    check_soft_cap,
    describe,
    is_count,
    is_int_array,
    shape,
)


def check_paged_cache(op: str, query: Any, key_cache: Any, value_cache: Any, query_layout: str) -> tuple[int, ...]:
    """``query`` and the caches ``key_cache [P, page, K, D]``, ``value_cache [P, page, K, Dv]`` (float8 allowed);
    returns query's shape."""
    q, kc = check_query_key_value(
        op,
        query,
        key_cache,
        value_cache,
        layouts=(query_layout, "[P, page, K, D]", "[P, page, K, Dv]"),
        names=("query", "key_cache", "value_cache"),
        same_batch=False,
        quantized_kv=True,
    )
    if kc[0] == 0 or kc[1] == 0:
        raise ValueError(f"{op}: key_cache needs at least one page of at least one token, got shape {list(kc)}")
    return q


def check_int(op: str, name: str, x: Any, want: tuple[int | None, ...], layout: str) -> tuple[int, ...]:
    """``x`` must be an integer array of shape ``want`` (``None``: any size); returns its shape."""
    if not is_int_array(x):
        raise TypeError(f"{op}: {name} must be an integer array {layout}, got {describe(x)}")
    got = shape(x)
    if len(got) != len(want) or any(w is not None and g != w for g, w in zip(got, want)):
        expected = "[" + ", ".join("*" if w is None else str(w) for w in want) + "]"
        raise ValueError(f"{op}: {name} must have shape {layout} = {expected}, got {list(got)}")
    return got


def check_options(op: str, softmax_scale: Any, logits_soft_cap: Any, sliding_window: Any) -> None:
    """The three options every serving op takes."""
    check_scale(op, "softmax_scale", softmax_scale)
    check_soft_cap(op, logits_soft_cap)
    if sliding_window is not None and not (is_count(sliding_window, 1) and sliding_window < 2**31):
        raise ValueError(
            f"{op}: sliding_window must be an int >= 1 and < 2**31 (the query sees its last W positions; positions "
            f"are int32) or None, got {sliding_window!r}"
        )


def check_cache_scales(op: str, kv_heads: int, **scales: Any) -> None:
    """``k_scale``/``v_scale`` (by name): None, a positive finite Python float, or a float array ``[]`` or ``[K]``
    (``TypeError`` for a wrong kind or dtype, ``ValueError`` for a wrong shape or a concrete value not finite > 0)."""
    for name, x in scales.items():
        if x is None:
            continue
        if isinstance(x, bool) or not (isinstance(x, int | float) or hasattr(x, "dtype")):
            raise TypeError(f"{op}: {name} must be a positive float, a float array [K] or None, got {type(x).__name__}")
        if isinstance(x, int | float):
            if not (np.isfinite(x) and x > 0):
                raise ValueError(f"{op}: {name} must be a positive finite float, got {x!r}")
            continue
        if str(np.dtype(x.dtype)) not in FLOAT_DTYPES:
            raise TypeError(f"{op}: {name} must be a float32, bfloat16 or float16 array, got {describe(x)}")
        if shape(x) not in ((), (kv_heads,)):
            raise ValueError(
                f"{op}: {name} must have shape [] or [K] = [{kv_heads}] (one per kv head), got {describe(x)}"
            )
        if isinstance(x, jax.core.Tracer):
            continue
        values = np.asarray(x, np.float32)
        if not bool(np.all(np.isfinite(values) & (values > 0))):
            raise ValueError(f"{op}: {name} must be > 0 and finite (a dequantization scale), got {values.tolist()}")


def fold_cache_scales(
    query: Any, k_scale: Any, v_scale: Any, softmax_scale: float | None, kv_axis: int = -2
) -> tuple[Any, float, Callable[[Any], Any]]:
    """``(query, softmax_scale, finish)`` with the cache scales folded out of the keys and values: a Python float
    ``k_scale`` multiplies the scores' scale (exact), an array one the query (per kv head, in float32 and rounded
    back to the query's dtype); ``finish(out)`` multiplies the output by ``v_scale`` (per kv head). The query's
    heads are on ``kv_axis`` (query head ``h`` reads kv head ``h // (H // K)``), its head dim last; so is the
    output's. ``softmax_scale`` None is ``D ** -0.5``.

    >>> q = jnp.ones((1, 4, 2)); k_scale = jnp.array([1.0, 3.0])  # 4 query heads on 2 kv heads
    >>> q2, scale, finish = fold_cache_scales(q, k_scale, 0.5, None)
    >>> q2[0, :, 0].tolist(), scale, finish(jnp.ones((1, 4, 2)))[0, 0].tolist()
    ([1.0, 1.0, 3.0, 3.0], 0.7071067811865476, [0.5, 0.5])
    """
    scale = float(query.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale)
    heads = query.shape[kv_axis]

    def per_head(x: Any) -> Any:  # [] or [K] -> broadcastable to the query's heads axis
        x = jnp.asarray(x, jnp.float32)
        if x.ndim:
            x = jnp.repeat(x, heads // x.shape[0])
        return x.reshape((heads,) + (1,) * (-kv_axis - 1)) if x.ndim else x

    if isinstance(k_scale, int | float):
        scale *= float(k_scale)
    elif k_scale is not None:
        query = (query.astype(jnp.float32) * per_head(k_scale)).astype(query.dtype)

    def finish(out: Any) -> Any:
        if v_scale is None:
            return out
        return (out.astype(jnp.float32) * per_head(v_scale)).astype(out.dtype)

    return query, scale, finish


def normalize_options(arguments: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """Canonical spellings: ``softmax_scale`` a float (its default filled in), the soft cap a float, the window an int."""
    scale = arguments["softmax_scale"]
    arguments["softmax_scale"] = float(head_dim**-0.5 if scale is None else scale)
    if arguments["logits_soft_cap"] is not None:
        arguments["logits_soft_cap"] = float(arguments["logits_soft_cap"])
    if arguments["sliding_window"] is not None:
        arguments["sliding_window"] = int(arguments["sliding_window"])
    return arguments


# ---- not differentiable ---------------------------------------------------------------------------


@partial(jax.custom_jvp, nondiff_argnums=(0,))
def _guard(op: str, *xs: Any) -> tuple[Any, ...]:
    return xs


@_guard.defjvp
def _guard_jvp(op: str, primals: Any, tangents: Any) -> Any:
    raise TypeError(
        f"{op}: not differentiable (a serving op: it reads a key/value cache at inference time). "
        f"To differentiate something else in the same computation, pass its inputs through jax.lax.stop_gradient."
    )


def refuse_gradients(op: str, *arrays: Any) -> tuple[Any, ...]:
    """``arrays`` unchanged; differentiating through them (grad, vjp, jvp, linearize) raises a ``TypeError``.

    JAX calls the rule only for inputs that carry a tangent, so inputs under ``jax.lax.stop_gradient``
    (or not differentiated at all) pass. Entries that are not arrays (``None``, a wrong argument that
    ``validate`` will name) pass through unguarded.
    """
    present = [i for i, x in enumerate(arrays) if hasattr(x, "dtype") and hasattr(x, "shape")]
    guarded = _guard(op, *(arrays[i] for i in present))
    out = list(arrays)
    for i, x in zip(present, guarded):
        out[i] = x
    return tuple(out)
