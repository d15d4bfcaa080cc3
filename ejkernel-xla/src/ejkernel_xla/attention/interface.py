"""XLA ``attention``: dense, the weights materialised (see ``_dense``)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from ejkernel.kernels.signatures._attention import attention_allowed, normalize_window

from ejkernel_xla.attention import _dense
from ejkernel_xla.params import NoParams


def heuristic_cfg(inv: Any, stage: str) -> NoParams:
    return NoParams()  # one fused dense pass: no blocks to choose


def attention(
    query, key, value, bias=None, *, attention_mask=None, softmax_scale=None, causal=False, sliding_window=None,
    logits_soft_cap=None, dropout_prob=0.0, dropout_seed=None, return_weights=False, fwd_params=None, bwd_params=None,
):  # fmt: skip
    """Dense attention (contract: ``ejkernel.modules.operations.attention``).

    No launch parameters (``NoParams``): the scores are one ``[B, H, T, S]`` array.
    """
    dropout_prob = float(dropout_prob)
    static_seed = seed = None
    if dropout_prob > 0:
        if dropout_seed is None:
            raise ValueError("attention: dropout_prob > 0 needs dropout_seed (an int or a scalar integer array)")
        if isinstance(dropout_seed, int | np.integer):
            static_seed = int(dropout_seed)  # static: part of the options
        else:
            seed = jnp.asarray(dropout_seed)  # an array, traced like the other inputs
    opts = _dense.DenseOptions(
        scale=float(query.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale),
        soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        dropout_prob=dropout_prob,
        static_seed=static_seed,
        return_weights=bool(return_weights),
    )
    h, kh = query.shape[2], key.shape[2]
    window = normalize_window(sliding_window)
    allowed = None
    if causal or window is not None:
        allowed = attention_allowed(query.shape[1], key.shape[1], causal=causal, sliding_window=window)
    if attention_mask is not None:
        mask = _dense.grouped(jnp.asarray(attention_mask), kh, h // kh)
        allowed = mask if allowed is None else allowed & mask
    q, k, v = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    return _dense.attention(opts, q, k, v, None if bias is None else jnp.asarray(bias), allowed, seed)


__all__ = ["attention", "heuristic_cfg"]
