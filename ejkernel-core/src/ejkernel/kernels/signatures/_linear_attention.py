"""Checks shared by the linear-attention contracts (``gla``, ``lightning_attn``, ``recurrent``, ``gated_delta_rule``).

Each message starts with the op's name and says which argument, what was expected and what came.
"""

from __future__ import annotations

from typing import Any

from ejkernel.kernels.signatures._checks import (
    check_bool,
    check_cu_seqlens,
    check_float,
    check_float_array,
    check_same_dtype,
    check_scale,
    shape,
)


def check_qkv(op: str, q: Any, k: Any, v: Any) -> tuple[int, int, int, int, int]:
    """``q``, ``k`` ``[B, T, H, K]`` and ``v`` ``[B, T, H, V]`` of one float dtype; returns ``(B, T, H, K, V)``."""
    b, t, h, dk = check_float_array(op, "q", q, "[B, T, H, K]")
    check_float_array(op, "k", k, "[B, T, H, K]")
    dv = check_float_array(op, "v", v, "[B, T, H, V]")[3]
    check_same_dtype(op, {"q": q, "k": k, "v": v})
    if shape(k) != (b, t, h, dk):
        raise ValueError(f"{op}: k must have the shape of q {[b, t, h, dk]}, got {list(shape(k))}")
    if shape(v)[:3] != (b, t, h):
        raise ValueError(f"{op}: v must be [B, T, H, V] = [{b}, {t}, {h}, V], got {list(shape(v))}")
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
    b, t, h, dk, dv = dims
    n = b if cu_seqlens is None else check_cu_seqlens(op, "cu_seqlens", cu_seqlens, b, t)
    if initial_state is not None:
        want = (n, h, dk, dv)
        if shape(initial_state) != want:
            what = "N" if cu_seqlens is not None else "B"
            raise ValueError(
                f"{op}: initial_state must be [{what}, H, K, V] = {list(want)}, got {list(shape(initial_state))}"
            )
        check_float(op, "initial_state", initial_state)
    check_scale(op, "scale", scale)
    check_bool(op, "output_final_state", output_final_state)
