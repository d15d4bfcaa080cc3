"""XLA ``scaled_dot_product_attention``: jax's semantics on the blockwise flash kernel (O(T) memory).

Every option maps onto those of ``flash_attention`` (``ejkernel_xla.flash_attention``), so no call
needs a dense path (T x S memory):

- jax's causal mask and window are top-left aligned (``i - left <= j <= i + right``, ``right = 0``
  under ``is_causal``); flash's are bottom-right aligned (``i + S - T - L <= j <= i + S - T + R``).
  Keys that no query can see (``j > T - 1 + right``) and queries that can see no key
  (``i > S - 1 + left``) are cut off first; on what is left (``T' x S'``) the band is flash's window
  with ``L = left + S' - T' >= 0`` and ``R = right - (S' - T') >= 0``. The cut rows are zeros. This is
  exact, and it is also where the cost drops: blocks outside the band are never visited.
- ``query_seq_lengths``/``key_value_seq_lengths`` and masks of shape ``[#B, 1, 1, #S]`` (key padding)
  or ``[#B, 1, #T, 1]`` (query padding) become segment ids (valid queries 0, padded ones -1, valid
  keys 0, padded ones -2), which cost O(T + S) and let the kernel skip whole padded tiles;
- other masks and a bias go to the kernel as ``[#B, #N, T', S']`` arrays (broadcast along T and S).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.kernels.signatures._attention import normalize_window
from ejkernel.ops.utils.datacarrier import BwdParams, FwdParams

from ejkernel_xla.flash_attention import interface as _flash


def _band(is_causal: bool, window: tuple[int, int] | None) -> tuple[int | None, int | None]:
    """``(left, right)`` of the top-left band ``i - left <= j <= i + right``; None is unbounded."""
    left = None if window is None else window[0]
    right = 0 if is_causal else (None if window is None else window[1])
    return left, right


def _cut(t: int, s: int, left: int | None, right: int | None) -> tuple[int, int]:
    """``(T', S')``: the queries that may see a key and the keys that some query may see."""
    s_used = s if right is None else min(s, t + right)  # keys past T - 1 + right: seen by no query
    t_used = t if left is None else min(t, s_used + left)  # queries past S' - 1 + left: see no key
    return t_used, s_used


def _flash_invocation(inv: Any) -> Any:
    """``inv`` with the query/key lengths the flash kernel will run on, for its block heuristics."""
    a = inv.arguments
    q, k = a["query"], a["key"]
    t, s = _cut(q.shape[1], k.shape[1], *_band(bool(a["is_causal"]), normalize_window(a["local_window_size"])))
    cut = {
        "query": jax.ShapeDtypeStruct((q.shape[0], max(t, 1), *q.shape[2:]), q.dtype),
        "key": jax.ShapeDtypeStruct((k.shape[0], max(s, 1), *k.shape[2:]), k.dtype),
    }
    return dataclasses.replace(inv, arguments={**a, **cut})


def heuristic_cfg(inv: Any, stage: str) -> FwdParams | BwdParams:
    """The flash kernel's blocks for the lengths it runs on."""
    return _flash.heuristic_cfg(_flash_invocation(inv), stage)


def candidate_cfgs(inv: Any, stage: str) -> list[FwdParams | BwdParams]:
    """The flash kernel's candidate blocks for the lengths it runs on."""
    return _flash.candidate_cfgs(_flash_invocation(inv), stage)


def _fit(x: jax.Array, t: int, s: int) -> jax.Array:
    """A ``[#B, #N, #T, #S]`` array cut to its first ``t`` rows and ``s`` columns (broadcast ones stay 1)."""
    return x[:, :, : min(t, x.shape[2]), : min(s, x.shape[3])]


def scaled_dot_product_attention(
    query, key, value, bias=None, mask=None, *, scale=None, is_causal=False, query_seq_lengths=None,
    key_value_seq_lengths=None, local_window_size=None, fwd_params=None, bwd_params=None,
):  # fmt: skip
    """jax's ``dot_product_attention`` on ``flash_attention`` (contract: ``ejkernel.modules.operations.scaled_dot_product_attention``).

    ``fwd_params``/``bwd_params``: the flash kernel's ``q_blocksize``/``kv_blocksize`` (see its interface).
    """
    b, t, n, h = query.shape
    s = key.shape[1]
    left, right = _band(bool(is_causal), normalize_window(local_window_size))
    t_used, s_used = _cut(t, s, left, right)
    if t_used == 0 or s_used == 0:
        return jnp.zeros((*query.shape[:3], value.shape[-1]), query.dtype)
    offset = s_used - t_used
    unbounded = t_used + s_used  # flash clips windows at T + S
    flash_left = unbounded if left is None else left + offset
    flash_right = unbounded if right is None else right - offset
    causal = right is not None and flash_right == 0 and left is None
    window = None if causal or (left is None and right is None) else (flash_left, flash_right)

    q = query[:, :t_used]
    k, v = key[:, :s_used], value[:, :s_used]
    if bias is not None:
        bias = jnp.broadcast_to(_fit(bias, t_used, s_used), (*bias.shape[:2], t_used, s_used))
    q_ok = None if query_seq_lengths is None else jnp.arange(t_used) < query_seq_lengths[:, None]
    kv_ok = None if key_value_seq_lengths is None else jnp.arange(s_used) < key_value_seq_lengths[:, None]
    if mask is not None and mask.shape[1] == 1 and (mask.shape[2] == 1 or mask.shape[3] == 1):
        if mask.shape[2] == 1:  # [#B, 1, 1, #S]: which keys each batch attends
            row = jnp.broadcast_to(_fit(mask, t_used, s_used)[:, 0, 0, :], (b, s_used))
            kv_ok = row if kv_ok is None else kv_ok & row
        else:  # [#B, 1, #T, 1]: which queries attend at all
            row = jnp.broadcast_to(_fit(mask, t_used, s_used)[:, 0, :, 0], (b, t_used))
            q_ok = row if q_ok is None else q_ok & row
        mask = None
    if mask is not None:
        mask = jnp.broadcast_to(_fit(mask, t_used, s_used), (*mask.shape[:2], t_used, s_used))
    q_seg = kv_seg = None
    if q_ok is not None or kv_ok is not None:
        q_seg = jnp.zeros((b, t_used), jnp.int32) if q_ok is None else jnp.where(q_ok, 0, -1).astype(jnp.int32)
        kv_seg = jnp.zeros((b, s_used), jnp.int32) if kv_ok is None else jnp.where(kv_ok, 0, -2).astype(jnp.int32)

    out = _flash.flash_attention(
        q, k, v, bias, attention_mask=mask, q_segment_ids=q_seg, kv_segment_ids=kv_seg, softmax_scale=scale,
        causal=causal, sliding_window=window, fwd_params=fwd_params, bwd_params=bwd_params,
    )  # fmt: skip
    if t_used < t:
        out = jnp.pad(out, ((0, 0), (0, t - t_used), (0, 0), (0, 0)))
    return out


__all__ = ["candidate_cfgs", "heuristic_cfg", "scaled_dot_product_attention"]
