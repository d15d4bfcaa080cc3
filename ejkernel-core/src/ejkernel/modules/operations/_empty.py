"""Results of calls with nothing to compute (``Kernel.empty_result``): zeros of the result's shape and dtype.

A zero-size result (no batch, no queries, no sequences) is empty whatever the op; a result whose rows
admit no key (no keys at all) is zeros, as every row that admits no key is in the attention contracts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def zeros_if_empty(shape: Sequence[int], dtype: Any, nothing: bool = False) -> jax.Array | None:
    """``zeros(shape, dtype)`` when the result is empty or there is ``nothing`` to compute it from, else None."""
    if nothing or math.prod(shape) == 0:
        return jnp.zeros(tuple(shape), dtype)
    return None


def attention_zeros(arguments: Mapping[str, Any], q: str = "query", k: str = "key", v: str = "value") -> Any:
    """Attention ``[..., T, H, D]`` queries over ``[B, S, K, D|Dv]`` keys/values: ``[..., T, H, Dv]`` zeros in the
    query's dtype when that is empty or ``S == 0`` (no row admits a key), else None."""
    query, key, value = arguments[q], arguments[k], arguments[v]
    return zeros_if_empty((*np.shape(query)[:-1], np.shape(value)[-1]), query.dtype, np.shape(key)[1] == 0)


def linear_attention_zeros(arguments: Mapping[str, Any]) -> Any:
    """``(o, final_state)`` of a linear-attention op when ``o [B, T, HV, V]`` is empty (``B == 0`` or ``HV == 0``;
    the contracts refuse ``T == 0``): the final state ``[B or N, HV, K, V]`` is then empty too. ``HV`` is the
    value heads (``v``'s), which are the heads of every op but the grouped ones (``gla``, ``gated_delta_rule``)."""
    b, t, _, dk = np.shape(arguments["q"])
    h, dv = np.shape(arguments["v"])[2:]
    o = zeros_if_empty((b, t, h, dv), arguments["q"].dtype)
    if o is None:
        return None
    cu = arguments.get("cu_seqlens")
    n = b if cu is None else np.shape(cu)[0] - 1
    return o, jnp.zeros((n, h, dk, dv), jnp.float32) if arguments["output_final_state"] else None
