"""Argument checks shared by the ops' ``validate`` functions (in ``ejkernel.modules.operations``).

Every check takes the op's name first and raises a ``ValueError`` (a wrong shape or value) or a
``TypeError`` (a wrong dtype or Python type) whose message starts with the op's name and says which
argument, what was expected and what came. Layouts are written as in the docstrings, ``"[B, T, H, D]"``:
their axis letters name the axes in messages.

Integer metadata (page tables, lengths, sequence offsets) is checked by value with ``check_values``: at once
when the values are concrete, and under ``jit`` (traced values) only with ``EJKERNEL_CHECKS=1``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

# What the public functions' array arguments accept (their annotations: ``Float[ArrayIn, "B T H D"]``): JAX
# arrays and NumPy arrays alike; what they return is a ``jax.Array``.
ArrayIn = jax.Array | np.ndarray

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")  # what a quantized key/value cache may hold (serving ops)
QKV_LAYOUTS = ("[B, T, H, D]", "[B, S, K, D]", "[B, S, K, Dv]")


def shape(x: Any) -> tuple[int, ...]:
    """The shape of an array, a ``jax.ShapeDtypeStruct`` or a tracer; ``()`` for a scalar."""
    return tuple(np.shape(x))


def dtype_name(x: Any) -> str:
    """``"float32"`` for an array, the type name for anything else."""
    return str(np.dtype(x.dtype)) if hasattr(x, "dtype") else type(x).__name__


def is_int_array(x: Any) -> bool:
    return hasattr(x, "dtype") and np.issubdtype(np.dtype(x.dtype), np.integer)


def is_count(x: Any, minimum: int) -> bool:
    """``x`` is an int (a NumPy integer too, never a bool) of at least ``minimum``."""
    return isinstance(x, int | np.integer) and not isinstance(x, bool) and bool(x >= minimum)


def describe(x: Any) -> str:
    """``float32[2, 3]`` for an array, the type name for anything else.

    >>> describe(np.zeros((2, 3), np.float32)), describe(None)
    ('float32[2, 3]', 'NoneType')
    """
    return f"{dtype_name(x)}{list(shape(x))}" if hasattr(x, "dtype") else type(x).__name__


def _axes(layout: str) -> list[str]:
    return layout.strip("[]").split(", ")


def _listed(names: list[str]) -> str:
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]


def check_float(op: str, name: str, x: Any) -> None:
    """``x`` must have a float dtype (``TypeError``)."""
    if dtype_name(x) not in FLOAT_DTYPES:
        raise TypeError(f"{op}: {name} must be float32, bfloat16 or float16, got {dtype_name(x)}")


def check_float_array(op: str, name: str, x: Any, layout: str) -> tuple[int, ...]:
    """``x`` must have as many dims as ``layout`` has axes (``ValueError``) and a float dtype; returns its shape.

    >>> check_float_array("op", "q", np.zeros((2, 3)), "[B, T, H]")
    Traceback (most recent call last):
    ValueError: op: q must be 3-D [B, T, H], got float64[2, 3]
    """
    ndim = len(_axes(layout))
    if len(shape(x)) != ndim:
        raise ValueError(f"{op}: {name} must be {ndim}-D {layout}, got {describe(x)}")
    check_float(op, name, x)
    return shape(x)


def check_same_dtype(op: str, named: dict[str, Any]) -> None:
    """The arrays of ``named`` (name -> array) must share one dtype (``TypeError``)."""
    if len({dtype_name(x) for x in named.values()}) > 1:
        got = ", ".join(f"{name} {dtype_name(x)}" for name, x in named.items())
        raise TypeError(f"{op}: {_listed(list(named))} must share a dtype, got {got}")


def check_heads(op: str, h: int, kh: int, letters: tuple[str, str] = ("H", "K")) -> None:
    """GQA: the query heads must be a multiple of the key/value heads (``letters`` name them in the message)."""
    if kh == 0 or h % kh:
        raise ValueError(f"{op}: query heads {letters[0]}={h} must be a multiple of key/value heads {letters[1]}={kh}")


def check_query_key_value(
    op: str,
    query: Any,
    key: Any,
    value: Any,
    *,
    layouts: tuple[str, str, str] = QKV_LAYOUTS,
    names: tuple[str, str, str] = ("query", "key", "value"),
    same_batch: bool = True,
    quantized_kv: bool = False,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Attention's query, key and value: float arrays of one dtype whose heads and head dims agree.

    With ``quantized_kv``, key and value may instead share a float8 dtype (``FP8_DTYPES``: a quantized cache).

    The last two axes of ``query`` and ``key`` are (heads, head dim); ``value`` is ``key`` with its own
    last dim. With ``same_batch`` the first axis of all three is the batch. Returns the shapes of
    ``query`` and ``key``.
    """
    q = check_float_array(op, names[0], query, layouts[0])
    if quantized_kv and FP8_DTYPES.count(dtype_name(key)) + FP8_DTYPES.count(dtype_name(value)):  # a float8 cache
        k, v = shape(key), shape(value)
        for name, x, layout in zip(names[1:], (key, value), layouts[1:]):
            if len(shape(x)) != len(_axes(layout)):
                raise ValueError(f"{op}: {name} must be {len(_axes(layout))}-D {layout}, got {describe(x)}")
        check_same_dtype(op, dict(zip(names[1:], (key, value))))
    else:
        k, v = (check_float_array(op, n, x, lay) for n, x, lay in zip(names[1:], (key, value), layouts[1:]))
        check_same_dtype(op, dict(zip(names, (query, key, value))))
    if same_batch and not q[0] == k[0] == v[0]:
        raise ValueError(f"{op}: batch sizes differ: {names[0]} {q[0]}, {names[1]} {k[0]}, {names[2]} {v[0]}")
    if k[-1] != q[-1]:
        raise ValueError(
            f"{op}: {names[1]} head dim must equal {names[0]} head dim {q[-1]}, got {names[1]} shape {list(k)}"
        )
    if v[:-1] != k[:-1]:
        want = ", ".join([*map(str, k[:-1]), _axes(layouts[2])[-1]])
        raise ValueError(f"{op}: {names[2]} must be {layouts[2]} = [{want}] like {names[1]}, got {list(v)}")
    check_heads(op, q[-2], k[-2], (_axes(layouts[0])[-2], _axes(layouts[1])[-2]))
    if q[-1] == 0:  # scores of no dims, and a default scale of D ** -0.5 = inf: no attention to speak of
        raise ValueError(f"{op}: {names[0]} head dim {_axes(layouts[0])[-1]} must be >= 1, got shape {list(q)}")
    return q, k


def check_segment_ids(op: str, q_segment_ids: Any, kv_segment_ids: Any, b: int, t: int, s: int) -> None:
    """Both segment ids or neither; integer arrays ``[B, T]`` and ``[B, S]``."""
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError(f"{op}: pass both q_segment_ids and kv_segment_ids, or neither")
    if q_segment_ids is None:
        return
    for name, x, want in (("q_segment_ids", q_segment_ids, (b, t)), ("kv_segment_ids", kv_segment_ids, (b, s))):
        if shape(x) != want or not is_int_array(x):
            raise ValueError(f"{op}: {name} must be an integer array of shape {list(want)}, got {describe(x)}")


def check_cu_seqlens(op: str, name: str, x: Any, batch: int, length: int, axis: str = "T") -> int:
    """Packed sequences: ``x`` a 1-D integer array ``[N+1]``, ``N >= 1``, and a batch of 1; returns ``N``.

    Its values (see ``check_values``) must be non-decreasing within ``[0, length]``, ``length`` the size of
    the packed axis ``axis``.
    """
    if len(shape(x)) != 1 or shape(x)[0] < 2 or not is_int_array(x):
        raise ValueError(f"{op}: {name} must be a 1-D integer array [N+1] with N >= 1, got {describe(x)}")
    if batch != 1:
        raise ValueError(f"{op}: with {name} the sequences are packed along {axis}, so batch must be 1, got {batch}")
    check_values(lambda cu: check_offsets(op, name, cu, length, axis), x)
    return shape(x)[0] - 1


def check_lengths(op: str, name: str, x: Any, batch: int, length: int, axis: str = "S") -> None:
    """Per-sequence lengths: ``x`` a 1-D integer array ``[B]`` with values within ``[0, length]`` (see
    ``check_values``), ``length`` the size of the axis ``axis`` they count along."""
    if len(shape(x)) != 1 or not is_int_array(x) or shape(x)[0] != batch:
        raise ValueError(f"{op}: {name} must be a 1-D integer array [B] = [{batch}], got {describe(x)}")

    def values(v: np.ndarray) -> None:
        at = first((v.astype(np.int64) < 0) | (v.astype(np.int64) > length))
        if at is not None:
            raise ValueError(f"{op}: {name}[{at[0]}] = {v[at]} is outside [0, {axis}] = [0, {length}]")

    check_values(values, x)


def check_scale(op: str, name: str, x: Any) -> None:
    """A scale option: a Python float (or int) or None (``TypeError``; a bool is no scale), finite (``ValueError``:
    a NaN or infinite scale would only make every output NaN)."""
    if x is not None and (isinstance(x, bool) or not isinstance(x, int | float)):
        raise TypeError(f"{op}: {name} must be a Python float or None, got {type(x).__name__}")
    if isinstance(x, float) and not math.isfinite(x):
        raise ValueError(f"{op}: {name} must be a finite float or None, got {x!r}")


def check_soft_cap(op: str, logits_soft_cap: Any) -> None:
    """``logits_soft_cap``: a positive finite float or None (``ValueError``; an infinite cap is no cap: pass None)."""
    if logits_soft_cap is not None and (
        isinstance(logits_soft_cap, bool)
        or not isinstance(logits_soft_cap, int | float)
        or not 0 < logits_soft_cap < math.inf
    ):
        raise ValueError(f"{op}: logits_soft_cap must be a positive finite float or None, got {logits_soft_cap!r}")


def check_bool(op: str, name: str, x: Any) -> None:
    """A flag: exactly ``True`` or ``False`` (``TypeError``), so that ``1`` or ``"yes"`` is not read as one."""
    if not isinstance(x, bool):
        raise TypeError(f"{op}: {name} must be a bool, got {type(x).__name__}")


def check_window(op: str, name: str, window: Any) -> None:
    """A window of attention: None, an int ``w >= 0`` (meaning ``(w, w)``) or a pair ``(left, right)`` of them.

    Python ints only (``normalize_window`` reads them as such), never bools.
    """
    if window is None:
        return
    pair = (window, window) if isinstance(window, int) else window
    if not (
        isinstance(pair, tuple | list)
        and len(pair) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in pair)
    ):
        raise ValueError(f"{op}: {name} must be an int >= 0 or a pair (left, right) of ints >= 0, got {window!r}")


# ---- values of integer metadata -------------------------------------------------------------------


def concrete(x: Any) -> np.ndarray | None:
    """The values of ``x`` as a NumPy array when they are known now, else None.

    None for a tracer (under ``jit``, ``vmap``, ``shard_map``), an abstract value (``jax.ShapeDtypeStruct``)
    or an array spread over other processes. A Python int counts as known.
    """
    if isinstance(x, jax.core.Tracer):
        return None
    if isinstance(x, jax.Array):
        return np.asarray(x) if x.is_fully_addressable else None
    if isinstance(x, np.ndarray | np.generic | int):
        return np.asarray(x)
    return None


def checks_enabled() -> bool:
    """``EJKERNEL_CHECKS=1``: check traced integer metadata too (read when a call is traced)."""
    return os.environ.get("EJKERNEL_CHECKS", "") not in ("", "0", "false", "False")


def check_values(check: Callable[..., None], *arrays: Any) -> None:
    """Run ``check`` (which raises ``ValueError``) on the values of ``arrays``, as NumPy arrays.

    All concrete: now, so an eager call fails before any kernel runs and ``jit`` pays nothing. Some traced:
    only with ``EJKERNEL_CHECKS=1``, as a ``jax.debug.callback`` that runs with the computation (once per
    element under ``vmap``); its ``ValueError`` then surfaces as a ``jax.errors.JaxRuntimeError`` that
    carries the message. (A ``checkify.check`` would refuse to lower unless the caller wrapped the whole
    computation in ``checkify.checkify``.)
    """
    values = [concrete(x) for x in arrays]
    if all(v is not None for v in values):
        check(*values)
    elif checks_enabled() and all(v is not None or isinstance(x, jax.core.Tracer) for x, v in zip(arrays, values)):
        args = [x if v is None else v for x, v in zip(arrays, values)]
        jax.debug.callback(lambda *xs: check(*(np.asarray(x) for x in xs)), *args)


def first(bad: np.ndarray) -> tuple[int, ...] | None:
    """The index of the first True of ``bad`` (row-major order), or None."""
    hits = np.argwhere(bad)
    return tuple(int(i) for i in hits[0]) if len(hits) else None


def check_offsets(op: str, name: str, cu: np.ndarray, length: int, axis: str = "T") -> None:
    """Offsets of packed sequences (``ValueError``): within ``[0, length]`` and non-decreasing.

    >>> check_offsets("op", "cu_seqlens", np.array([0, 5, 3, 8]), 8)
    Traceback (most recent call last):
    ValueError: op: cu_seqlens must be non-decreasing, got cu_seqlens[2] = 3 after cu_seqlens[1] = 5
    """
    cu = np.asarray(cu).astype(np.int64)  # uint offsets would wrap in the differences
    at = first((cu < 0) | (cu > length))
    if at is not None:
        raise ValueError(f"{op}: {name}[{at[0]}] = {cu[at]} is outside [0, {axis}] = [0, {length}]")
    at = first(np.diff(cu) < 0)
    if at is not None:
        i = at[0] + 1
        raise ValueError(
            f"{op}: {name} must be non-decreasing, got {name}[{i}] = {cu[i]} after {name}[{i - 1}] = {cu[i - 1]}"
        )


def check_pages(
    op: str,
    tables_name: str,
    tables: np.ndarray,
    lens_name: str,
    lens: np.ndarray,
    page: int,
    num_pages: int,
) -> None:
    """A paged cache's metadata (``ValueError``): ``0 <= lens[n] <= M * page``, and the entries of
    ``tables[n]`` that row ``n`` reads (its first ``ceil(lens[n] / page)``) within ``[0, P)``; the other
    entries are padding and may hold anything.
    """
    lens, tables = np.asarray(lens).astype(np.int64), np.asarray(tables).astype(np.int64)
    m = tables.shape[1]
    at = first((lens < 0) | (lens > m * page))
    if at is not None:
        raise ValueError(
            f"{op}: {lens_name}[{at[0]}] = {lens[at]} is outside [0, M * page] = [0, {m * page}] "
            f"({tables_name} holds M = {m} pages of page = {page} tokens per sequence)"
        )
    pages = -(-lens // max(page, 1))  # the pages each row reads
    at = first((np.arange(m)[None, :] < pages[:, None]) & ((tables < 0) | (tables >= num_pages)))
    if at is not None:
        n, c = at
        raise ValueError(
            f"{op}: {tables_name}[{n}, {c}] = {tables[at]} is not a page of the cache: row {n} reads its first "
            f"ceil({lens_name}[{n}] / page) = {pages[n]} entries, which must be in [0, P) = [0, {num_pages})"
        )
