"""The ``gated_delta_rule`` contract (the recurrence of Gated DeltaNet).

Shapes: B batch, T length, H heads, K query/key head dim, V value head dim, N packed sequences.

For every batch row (or packed sequence) and head, with a state ``S`` of shape ``[K, V]`` that starts
at ``initial_state`` (zeros when absent), token by token (``a_t = exp(g_t)``):

1. with ``use_qk_l2norm``: ``q_t = q_t / sqrt(|q_t|^2 + 1e-6)``, likewise ``k_t`` (in float32);
2. ``S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``, that is: decay the state, read the
   value it holds for ``k_t``, and move it a fraction ``beta_t`` of the way towards ``v_t``
   (``S = a S; S += beta k (v - S^T k)^T``);
3. ``o_t = scale * S_t^T q_t`` (``scale`` defaults to ``K ** -0.5``).

This is the convention of flash-linear-attention's ``chunk_gated_delta_rule``. ``g`` is the log of the
decay and ``beta`` the writing strength; with ``g <= 0``, ``beta`` in ``[0, 1]`` and unit-norm keys every
step is a contraction and the state stays bounded (none of this is checked: it is data). The gates may
have another float dtype than ``q``, ``k``, ``v`` (float32 gates beside bfloat16 activations are usual).
Everything is computed in float32; the output has ``q``'s dtype and the final state is float32.

With ``cu_seqlens`` (B == 1) the sequences ``[cu_seqlens[n], cu_seqlens[n + 1])`` are packed along T:
each starts from ``initial_state[n]`` (``[N, H, K, V]``) and its final state is ``final_state[n]``. A
sequence of length 0 outputs nothing and its final state is its initial state; tokens outside
``[cu_seqlens[0], cu_seqlens[N])`` give zeros. ``cu_seqlens`` must be non-decreasing within ``[0, T]``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jaxtyping import Array, Float, Int

from ejkernel.kernels.params import BwdParams, FwdParams

_FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def gated_delta_rule(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T H K"],
    v: Float[Array, "B T H V"],
    g: Float[Array, "B T H"],
    beta: Float[Array, "B T H"],
    *,
    scale: float | None = None,
    initial_state: Float[Array, "B_or_N H K V"] | None = None,
    output_final_state: bool = False,
    cu_seqlens: Int[Array, "N+1"] | None = None,
    use_qk_l2norm: bool = False,
    fwd_params: FwdParams | None = None,
    bwd_params: BwdParams | None = None,
) -> tuple[Float[Array, "B T H V"], Float[Array, "B_or_N H K V"] | None]:
    """Canonical signature of ``gated_delta_rule`` (see the module docstring for the semantics)."""
    raise NotImplementedError


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(np.shape(x))


def _dtype(x: Any) -> str:
    return str(np.dtype(x.dtype)) if hasattr(x, "dtype") else type(x).__name__


def validate(
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    beta: Any,
    *,
    scale: float | None = None,
    initial_state: Any = None,
    output_final_state: bool = False,
    cu_seqlens: Any = None,
    use_qk_l2norm: bool = False,
    **_: Any,
) -> None:
    """Check a ``gated_delta_rule`` call; raise an error naming the argument, what was expected and what came."""
    layouts = {"q": "[B, T, H, K]", "k": "[B, T, H, K]", "v": "[B, T, H, V]", "g": "[B, T, H]", "beta": "[B, T, H]"}
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if len(_shape(x)) != len(layouts[name].split(",")):
            raise ValueError(
                f"gated_delta_rule: {name} must be {len(layouts[name].split(','))}-D {layouts[name]}, got shape {list(_shape(x))}"
            )
        if _dtype(x) not in _FLOAT_DTYPES:
            raise TypeError(f"gated_delta_rule: {name} must be float32, bfloat16 or float16, got {_dtype(x)}")
    if not (_dtype(q) == _dtype(k) == _dtype(v)):
        raise TypeError(f"gated_delta_rule: q, k and v must share a dtype, got {_dtype(q)}, {_dtype(k)}, {_dtype(v)}")
    b, t, h, dk = _shape(q)
    if _shape(k) != (b, t, h, dk):
        raise ValueError(f"gated_delta_rule: k must have the shape of q {[b, t, h, dk]}, got {list(_shape(k))}")
    if _shape(v)[:3] != (b, t, h):
        raise ValueError(f"gated_delta_rule: v must be [B, T, H, V] = [{b}, {t}, {h}, V], got {list(_shape(v))}")
    for name, x in (("g", g), ("beta", beta)):
        if _shape(x) != (b, t, h):
            raise ValueError(f"gated_delta_rule: {name} must be [B, T, H] = {[b, t, h]}, got {list(_shape(x))}")
    if dk == 0 or _shape(v)[3] == 0:
        raise ValueError(f"gated_delta_rule: head dims K and V must be positive, got K={dk}, V={_shape(v)[3]}")
    if t == 0:
        raise ValueError(f"gated_delta_rule: the length T must be at least 1, got q of shape {list(_shape(q))}")
    n = b
    if cu_seqlens is not None:
        cs = _shape(cu_seqlens)
        if (
            len(cs) != 1
            or cs[0] < 2
            or not (hasattr(cu_seqlens, "dtype") and np.issubdtype(cu_seqlens.dtype, np.integer))
        ):
            raise ValueError(
                f"gated_delta_rule: cu_seqlens must be a 1-D integer array [N+1] with N >= 1, got {_dtype(cu_seqlens)}{list(cs)}"
            )
        if b != 1:
            raise ValueError(
                f"gated_delta_rule: with cu_seqlens the sequences are packed along T, so batch must be 1, got {b}"
            )
        n = cs[0] - 1
    if initial_state is not None:
        want = (n, h, dk, _shape(v)[3])
        if _shape(initial_state) != want:
            what = "N" if cu_seqlens is not None else "B"
            raise ValueError(
                f"gated_delta_rule: initial_state must be [{what}, H, K, V] = {list(want)}, got {list(_shape(initial_state))}"
            )
        if _dtype(initial_state) not in _FLOAT_DTYPES:
            raise TypeError(
                f"gated_delta_rule: initial_state must be float32, bfloat16 or float16, got {_dtype(initial_state)}"
            )
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, int | float)):
        raise TypeError(f"gated_delta_rule: scale must be a Python float or None, got {type(scale).__name__}")
    for name, flag in (("output_final_state", output_final_state), ("use_qk_l2norm", use_qk_l2norm)):
        if not isinstance(flag, bool):
            raise TypeError(f"gated_delta_rule: {name} must be a bool, got {type(flag).__name__}")
