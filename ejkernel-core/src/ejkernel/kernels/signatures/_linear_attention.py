"""Checks shared by the linear-attention contracts (``gla``, ``lightning_attn``, ``recurrent``, ``gated_delta_rule``).

Each message starts with the op's name and says which argument, what was expected and what came.

``gla`` and ``gated_delta_rule`` take grouped value heads: ``q``, ``k`` ``[B, T, H, K]`` and ``v``
``[B, T, HV, V]`` with ``HV`` a multiple of ``H``; value head ``hv`` reads query/key head ``hv // (HV // H)``
(the grouping of GQA), and the gates, the state and the output follow the value heads
(``check_grouped_qkv``, ``repeat_query_key_heads``). ``lightning_attn`` and ``recurrent`` take one head
count (``check_qkv``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.kernels.signatures._checks import (
    check_bool,
    check_cu_seqlens,
    check_float,
    check_float_array,
    check_same_dtype,
    check_scale,
    shape,
)


def _check_qk(op: str, q: Any, k: Any, v: Any, v_layout: str) -> tuple[int, int, int, int]:
    """``q``, ``k`` ``[B, T, H, K]`` and a 4-D ``v`` of one float dtype; returns ``(B, T, H, K)``."""
    b, t, h, dk = check_float_array(op, "q", q, "[B, T, H, K]")
    check_float_array(op, "k", k, "[B, T, H, K]")
    check_float_array(op, "v", v, v_layout)
    check_same_dtype(op, {"q": q, "k": k, "v": v})
    if shape(k) != (b, t, h, dk):
        raise ValueError(f"{op}: k must have the shape of q {[b, t, h, dk]}, got {list(shape(k))}")
    return b, t, h, dk


def _check_sizes(op: str, q: Any, t: int, dk: int, dv: int) -> None:
    if dk == 0 or dv == 0:
        raise ValueError(f"{op}: head dims K and V must be positive, got K={dk}, V={dv}")
    if t == 0:
        raise ValueError(f"{op}: the length T must be at least 1, got q of shape {list(shape(q))}")


def check_qkv(op: str, q: Any, k: Any, v: Any) -> tuple[int, int, int, int, int]:
    """``q``, ``k`` ``[B, T, H, K]`` and ``v`` ``[B, T, H, V]`` of one float dtype; returns ``(B, T, H, K, V)``."""
    b, t, h, dk = _check_qk(op, q, k, v, "[B, T, H, V]")
    dv = shape(v)[3]
    if shape(v)[:3] != (b, t, h):
        raise ValueError(f"{op}: v must be [B, T, H, V] = [{b}, {t}, {h}, V], got {list(shape(v))}")
    _check_sizes(op, q, t, dk, dv)
    return b, t, h, dk, dv


def check_grouped_qkv(op: str, q: Any, k: Any, v: Any) -> tuple[int, int, int, int, int, int]:
    """``q``, ``k`` ``[B, T, H, K]`` and ``v`` ``[B, T, HV, V]``, ``HV`` a positive multiple of ``H`` (or both 0:
    an empty call), of one float dtype; returns ``(B, T, H, HV, K, V)``."""
    b, t, h, dk = _check_qk(op, q, k, v, "[B, T, HV, V]")
    hv, dv = shape(v)[2:]
    grouped = hv % h == 0 and hv >= h if h else hv == 0
    if shape(v)[:2] != (b, t) or not grouped:
        raise ValueError(
            f"{op}: v must be [B, T, HV, V] = [{b}, {t}, HV, V] with HV a positive multiple of H = {h} "
            f"(value head hv reads query/key head hv // (HV // H)), got {list(shape(v))}"
        )
    _check_sizes(op, q, t, dk, dv)
    return b, t, h, hv, dk, dv


def repeat_query_key_heads(q: jax.Array, k: jax.Array, value_heads: int) -> tuple[jax.Array, jax.Array]:
    """``q``, ``k`` ``[B, T, H, K]`` repeated along the heads to ``[B, T, HV, K]`` (``HV = value_heads``, a multiple
    of ``H``): head ``hv`` of the result is head ``hv // (HV // H)``, so an implementation written for one head
    count serves grouped value heads. Their gradients sum over each group (the transpose of the repeat).
    Unchanged when ``HV == H``.
    """
    h = q.shape[2]
    if value_heads == h:
        return q, k
    groups = value_heads // h
    return jnp.repeat(q, groups, axis=2), jnp.repeat(k, groups, axis=2)


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
    heads: str = "H",
) -> None:
    """``scale``, ``initial_state`` (``[B or N, H, K, V]``), ``output_final_state`` and ``cu_seqlens``.

    ``dims`` is ``(B, T, H, K, V)`` with ``H`` the heads of the state, named ``heads`` in messages (``"HV"``:
    the value heads of the grouped ops).
    """
    b, t, h, dk, dv = dims
    n = b if cu_seqlens is None else check_cu_seqlens(op, "cu_seqlens", cu_seqlens, b, t)
    if initial_state is not None:
        want = (n, h, dk, dv)
        if shape(initial_state) != want:
            what = "N" if cu_seqlens is not None else "B"
            raise ValueError(
                f"{op}: initial_state must be [{what}, {heads}, K, V] = {list(want)}, got {list(shape(initial_state))}"
            )
        check_float(op, "initial_state", initial_state)
    check_scale(op, "scale", scale)
    check_bool(op, "output_final_state", output_final_state)
