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
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax

from ejkernel.kernels.signatures._checks import (
    check_query_key_value,
    check_scale,
    check_soft_cap,
    describe,
    is_count,
    is_int_array,
    shape,
)


def check_paged_cache(op: str, query: Any, key_cache: Any, value_cache: Any, query_layout: str) -> tuple[int, ...]:
    """``query`` and the caches ``key_cache [P, page, K, D]``, ``value_cache [P, page, K, Dv]``; returns query's shape."""
    q, kc = check_query_key_value(
        op,
        query,
        key_cache,
        value_cache,
        layouts=(query_layout, "[P, page, K, D]", "[P, page, K, Dv]"),
        names=("query", "key_cache", "value_cache"),
        same_batch=False,
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
    if sliding_window is not None and not is_count(sliding_window, 1):
        raise ValueError(
            f"{op}: sliding_window must be an int >= 1 (the query sees its last W positions) or None, "
            f"got {sliding_window!r}"
        )


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
