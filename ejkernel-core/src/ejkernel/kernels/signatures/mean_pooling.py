"""The ``mean_pooling`` contract.

Shapes: B batch, T length, D features, N packed sequences.

Without ``cu_seqlens``: ``out[b] = mean(x[b, :T])``, ``[B, D]`` (zeros when T == 0).

With ``cu_seqlens`` (B == 1, ``[N+1]``, non-decreasing within ``[0, T]``): the sequences
``[cu_seqlens[n], cu_seqlens[n + 1])`` are packed along T and ``out[n]`` is the mean of sequence n,
``[N, D]``; an empty sequence gives zeros (never NaN) and tokens outside ``[cu_seqlens[0], cu_seqlens[N])``
count for nothing.

The sums are accumulated in float32 and the result has ``x``'s dtype; it is differentiable in ``x``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jaxtyping import Array, Float, Int

from ejkernel.kernels.params import BwdParams, FwdParams

_FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def mean_pooling(
    x: Float[Array, "B T D"],
    *,
    cu_seqlens: Int[Array, "N+1"] | None = None,
    fwd_params: FwdParams | None = None,
    bwd_params: BwdParams | None = None,
) -> Float[Array, "B_or_N D"]:
    """Canonical signature of ``mean_pooling`` (see the module docstring for the semantics)."""
    raise NotImplementedError


def _dtype(x: Any) -> str:
    return str(np.dtype(x.dtype)) if hasattr(x, "dtype") else type(x).__name__


def validate(x: Any, *, cu_seqlens: Any = None, **_: Any) -> None:
    """Check a ``mean_pooling`` call; raise an error naming the argument, what was expected and what came."""
    shape = tuple(np.shape(x))
    if len(shape) != 3:
        raise ValueError(f"mean_pooling: x must be 3-D [B, T, D], got shape {list(shape)}")
    if _dtype(x) not in _FLOAT_DTYPES:
        raise TypeError(f"mean_pooling: x must be float32, bfloat16 or float16, got {_dtype(x)}")
    if cu_seqlens is not None:
        cs = tuple(np.shape(cu_seqlens))
        if (
            len(cs) != 1
            or cs[0] < 2
            or not (hasattr(cu_seqlens, "dtype") and np.issubdtype(cu_seqlens.dtype, np.integer))
        ):
            raise ValueError(
                f"mean_pooling: cu_seqlens must be a 1-D integer array [N+1] with N >= 1, got {_dtype(cu_seqlens)}{list(cs)}"
            )
        if shape[0] != 1:
            raise ValueError(
                f"mean_pooling: with cu_seqlens the sequences are packed along T, so batch must be 1, got {shape[0]}"
            )
