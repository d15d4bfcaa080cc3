"""Argument checks shared by the signature modules' ``validate`` functions.

Every check takes the op's name first and raises a ``ValueError`` (a wrong shape or value) or a
``TypeError`` (a wrong dtype or Python type) whose message starts with the op's name and says which
argument, what was expected and what came. Layouts are written as in the docstrings, ``"[B, T, H, D]"``:
their axis letters name the axes in messages.
"""

from __future__ import annotations

from typing import Any

import numpy as np

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
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
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Attention's query, key and value: float arrays of one dtype whose heads and head dims agree.

    The last two axes of ``query`` and ``key`` are (heads, head dim); ``value`` is ``key`` with its own
    last dim. With ``same_batch`` the first axis of all three is the batch. Returns the shapes of
    ``query`` and ``key``.
    """
    q, k, v = (check_float_array(op, n, x, lay) for n, x, lay in zip(names, (query, key, value), layouts))
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


def check_cu_seqlens(op: str, name: str, x: Any, batch: int) -> int:
    """Packed sequences: ``x`` a 1-D integer array ``[N+1]``, ``N >= 1``, and a batch of 1; returns ``N``."""
    if len(shape(x)) != 1 or shape(x)[0] < 2 or not is_int_array(x):
        raise ValueError(f"{op}: {name} must be a 1-D integer array [N+1] with N >= 1, got {describe(x)}")
    if batch != 1:
        raise ValueError(f"{op}: with {name} the sequences are packed along T, so batch must be 1, got {batch}")
    return shape(x)[0] - 1


def check_scale(op: str, name: str, x: Any) -> None:
    """A scale option: a Python float (or int) or None (``TypeError``); a bool is no scale."""
    if x is not None and (isinstance(x, bool) or not isinstance(x, int | float)):
        raise TypeError(f"{op}: {name} must be a Python float or None, got {type(x).__name__}")


def check_soft_cap(op: str, logits_soft_cap: Any) -> None:
    """``logits_soft_cap``: a positive float or None (``ValueError``)."""
    if logits_soft_cap is not None and (
        isinstance(logits_soft_cap, bool) or not isinstance(logits_soft_cap, int | float) or not logits_soft_cap > 0
    ):
        raise ValueError(f"{op}: logits_soft_cap must be a positive float or None, got {logits_soft_cap!r}")


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
