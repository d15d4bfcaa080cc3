"""What the three serving contracts share: checks of arrays and options, and the refusal to differentiate.

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
import numpy as np

FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def shape(x: Any) -> tuple[int, ...]:
    return tuple(np.shape(x))


def dtype_name(x: Any) -> str:
    return str(np.dtype(x.dtype)) if hasattr(x, "dtype") else type(x).__name__


def is_int_array(x: Any) -> bool:
    return hasattr(x, "dtype") and np.issubdtype(np.dtype(x.dtype), np.integer)


def describe(x: Any) -> str:
    """``float32[2, 3]`` for an array, the type name for anything else."""
    return f"{dtype_name(x)}{list(shape(x))}" if hasattr(x, "dtype") else type(x).__name__


def check_float(op: str, name: str, x: Any, ndim: int, layout: str) -> tuple[int, ...]:
    """``x`` must be a float array of ``ndim`` dimensions; returns its shape."""
    if not hasattr(x, "dtype") or len(shape(x)) != ndim:
        raise ValueError(f"{op}: {name} must be a {ndim}-D array {layout}, got {describe(x)}")
    if dtype_name(x) not in FLOAT_DTYPES:
        raise TypeError(f"{op}: {name} must be float32, bfloat16 or float16, got {dtype_name(x)}")
    return shape(x)


def check_int(op: str, name: str, x: Any, want: tuple[int | None, ...], layout: str) -> tuple[int, ...]:
    """``x`` must be an integer array of shape ``want`` (``None``: any size); returns its shape."""
    if not is_int_array(x):
        raise TypeError(f"{op}: {name} must be an integer array {layout}, got {describe(x)}")
    got = shape(x)
    if len(got) != len(want) or any(w is not None and g != w for g, w in zip(got, want)):
        expected = "[" + ", ".join("*" if w is None else str(w) for w in want) + "]"
        raise ValueError(f"{op}: {name} must have shape {layout} = {expected}, got {list(got)}")
    return got


def check_same_dtype(op: str, named: dict[str, Any]) -> None:
    dtypes = {dtype_name(x) for x in named.values()}
    if len(dtypes) > 1:
        got = ", ".join(f"{k} {dtype_name(x)}" for k, x in named.items())
        raise TypeError(f"{op}: {', '.join(named)} must share a dtype, got {got}")


def check_heads(op: str, h: int, kh: int) -> None:
    if kh == 0 or h % kh:
        raise ValueError(f"{op}: query heads H={h} must be a multiple of key/value heads K={kh}")


def check_options(op: str, softmax_scale: Any, logits_soft_cap: Any, sliding_window: Any) -> None:
    """The three options every serving op takes."""
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, int | float)):
        raise TypeError(f"{op}: softmax_scale must be a Python float or None, got {type(softmax_scale).__name__}")
    if logits_soft_cap is not None and (
        isinstance(logits_soft_cap, bool) or not isinstance(logits_soft_cap, int | float) or not logits_soft_cap > 0
    ):
        raise ValueError(f"{op}: logits_soft_cap must be a positive float or None, got {logits_soft_cap!r}")
    if sliding_window is not None and (
        isinstance(sliding_window, bool) or not isinstance(sliding_window, int | np.integer) or sliding_window < 1
    ):
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
