"""The ``mean_pooling`` contract.

Shapes: B batch, T length, D features, N packed sequences.

Without ``cu_seqlens``: ``out[b] = mean(x[b, :T])``, ``[B, D]`` (zeros when T == 0).

With ``cu_seqlens`` (B == 1, ``[N+1]``, non-decreasing within ``[0, T]``): the sequences
``[cu_seqlens[n], cu_seqlens[n + 1])`` are packed along T and ``out[n]`` is the mean of sequence n,
``[N, D]``; an empty sequence gives zeros (never NaN) and tokens outside ``[cu_seqlens[0], cu_seqlens[N])``
count for nothing. Concrete ``cu_seqlens`` are checked (``ValueError``); under ``jit`` they are traced and
unchecked unless ``EJKERNEL_CHECKS=1`` (then the call fails when it runs), and offsets outside ``[0, T]`` or
decreasing give wrong means without an error.

The sums are accumulated in float32 and the result has ``x``'s dtype; it is differentiable in ``x``.
"""

from __future__ import annotations

from typing import Any

from jaxtyping import Array, Float, Int

from ejkernel.kernels.params import BwdParams, FwdParams
from ejkernel.kernels.signatures._checks import check_cu_seqlens, check_float_array


def mean_pooling(
    x: Float[Array, "B T D"],
    *,
    cu_seqlens: Int[Array, "N+1"] | None = None,
    fwd_params: FwdParams | None = None,
    bwd_params: BwdParams | None = None,
) -> Float[Array, "B_or_N D"]:
    """Canonical signature of ``mean_pooling`` (see the module docstring for the semantics)."""
    raise NotImplementedError


def validate(x: Any, *, cu_seqlens: Any = None, **_: Any) -> None:
    """Check a ``mean_pooling`` call; raise an error naming the argument, what was expected and what came."""
    b, t = check_float_array("mean_pooling", "x", x, "[B, T, D]")[:2]
    if cu_seqlens is not None:
        check_cu_seqlens("mean_pooling", "cu_seqlens", cu_seqlens, b, t)
