"""Checks shared by the linear-attention contracts (``gla``, ``lightning_attn``, ``recurrent``).

Each message starts with the op's name and says which argument, what was expected and what came.
"""

from __future__ import annotations

from typing import Any

import numpy as np

FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def shape(x: Any) -> tuple[int, ...]:
    return tuple(np.shape(x))


def dtype(x: Any) -> str:
    return str(np.dtype(x.dtype)) if hasattr(x, "dtype") else type(x).__name__


def check_float(op: str, name: str, x: Any) -> None:
    if dtype(x) not in FLOAT_DTYPES:
        raise TypeError(f"{op}: {name} must be float32, bfloat16 or float16, got {dtype(x)}")


def check_qkv(op: str, q: Any, k: Any, v: Any) -> tuple[int, int, int, int, int]:
    """``q``, ``k`` ``[B, T, H, K]`` and ``v`` ``[B, T, H, V]`` of one float dtype; returns ``(B, T, H, K, V)``."""
    for name, x, layout in (("q", q, "[B, T, H, K]"), ("k", k, "[B, T, H, K]"), ("v", v, "[B, T, H, V]")):
        if len(shape(x)) != 4:
            raise ValueError(f"{op}: {name} must be 4-D {layout}, got shape {list(shape(x))}")
        check_float(op, name, x)
    if not (dtype(q) == dtype(k) == dtype(v)):
        raise TypeError(f"{op}: q, k and v must share a dtype, got {dtype(q)}, {dtype(k)}, {dtype(v)}")
    b, t, h, dk = shape(q)
    if shape(k) != (b, t, h, dk):
        raise ValueError(f"{op}: k must have the shape of q {[b, t, h, dk]}, got {list(shape(k))}")
    if shape(v)[:3] != (b, t, h):
        raise ValueError(f"{op}: v must be [B, T, H, V] = [{b}, {t}, {h}, V], got {list(shape(v))}")
    dv = shape(v)[3]
    if dk == 0 or dv == 0:
        raise ValueError(f"{op}: head dims K and V must be positive, got K={dk}, V={dv}")
    if t == 0:
        raise ValueError(f"{op}: the length T must be at least 1, got q of shape {list(shape(q))}")
    return b, t, h, dk, dv


def check_gate(op: str, name: str, x: Any, want: tuple[int, ...], layout: str) -> None:
    """A gate of exactly ``want`` (``layout`` names its axes), any float dtype."""
    if shape(x) != want:
        raise ValueError(f"{op}: {name} must be {layout} = {list(want)}, got {list(shape(x))}")
    check_float(op, name, x)


def check_state_options(
    op: str,
    dims: tuple[int, int, int, int, int],
    *,
    scale: Any,
    initial_state: Any,
    output_final_state: Any,
    cu_seqlens: Any,
) -> None:
    """``scale``, ``initial_state`` (``[B or N, H, K, V]``), ``output_final_state`` and ``cu_seqlens``."""
    b, _, h, dk, dv = dims
    n = b
    if cu_seqlens is not None:
        cs = shape(cu_seqlens)
        is_int = hasattr(cu_seqlens, "dtype") and np.issubdtype(np.dtype(cu_seqlens.dtype), np.integer)
        if len(cs) != 1 or cs[0] < 2 or not is_int:
            raise ValueError(
                f"{op}: cu_seqlens must be a 1-D integer array [N+1] with N >= 1, got {dtype(cu_seqlens)}{list(cs)}"
            )
        if b != 1:
            raise ValueError(f"{op}: with cu_seqlens the sequences are packed along T, so batch must be 1, got {b}")
        n = cs[0] - 1
    if initial_state is not None:
        want = (n, h, dk, dv)
        if shape(initial_state) != want:
            what = "N" if cu_seqlens is not None else "B"
            raise ValueError(
                f"{op}: initial_state must be [{what}, H, K, V] = {list(want)}, got {list(shape(initial_state))}"
            )
        check_float(op, "initial_state", initial_state)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, int | float)):
        raise TypeError(f"{op}: scale must be a Python float or None, got {type(scale).__name__}")
    if not isinstance(output_final_state, bool):
        raise TypeError(f"{op}: output_final_state must be a bool, got {type(output_final_state).__name__}")
