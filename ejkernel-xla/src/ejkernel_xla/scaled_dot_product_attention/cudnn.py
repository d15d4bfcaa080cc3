"""cuDNN's fused attention through ``jax.nn.dot_product_attention(implementation="cudnn")``, for NVIDIA GPUs.

``scaled_dot_product_attention`` has jax's semantics, so its options pass straight through; the
cuDNN path of ``flash_attention`` (``ejkernel_xla.flash_attention.cudnn``) calls cuDNN through the same
``dot_product_attention`` and ``unsupported_inputs`` below. ``supports`` refuses what cuDNN cannot do,
and what it does differently from the contract, so that the chain picks another implementation:

- dtypes other than bfloat16/float16, head dims that are not a multiple of 8 up to 128 (256 on
  Hopper and later), ``Hv != H``;
- ``mask``: jax hands cuDNN a boolean mask as a large negative bias, so a row it masks whole would
  average the values instead of giving zeros;
- a bias in another dtype than the query's, or (for its gradient) with an odd T or S; likewise
  ``is_causal`` with an odd T or S, which jax 0.11 hands cuDNN as a bias;
- windows with a right side (cuDNN's window is ``(i - left - 1, i]``), and windows that leave a query
  row without any key (``T > S + left``).

Not checked (the inputs are traced): a ``key_value_seq_lengths`` entry of 0 leaves its rows to cuDNN's
own handling of empty rows. Query rows past ``query_seq_lengths`` are set to zero here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.device import first_gpu
from ejkernel.kernels.params import BwdParams, FwdParams
from ejkernel.kernels.signatures._attention import normalize_window

HALF_DTYPES = ("bfloat16", "float16")
# What cuDNN's flash attention takes on every architecture it runs on (jax checks this too), and on
# Hopper and later (sm_90+), which also take up to 256 (measured on the H200: BENCHMARKS.md).
HEAD_DIMS = tuple(range(8, 129, 8))
HOPPER_HEAD_DIMS = tuple(range(8, 257, 8))


def hopper_or_later() -> bool:
    """Whether the first GPU is an NVIDIA sm_90 or newer (False where there is none)."""
    gpu = first_gpu()
    return gpu is not None and gpu.has_capability(9, 0)


def _describe(dims: Sequence[int]) -> str:
    if tuple(dims) in (HEAD_DIMS, HOPPER_HEAD_DIMS):
        return f"multiples of 8 up to {dims[-1]}"
    return " and ".join((", ".join(str(d) for d in dims[:-1]), str(dims[-1]))) if len(dims) > 1 else str(dims[0])


def unsupported_inputs(query: Any, value: Any, head_dims: Sequence[int] | None = None) -> str | None:
    """Why cuDNN cannot take these queries/values (dtype, head dims), or None; ``head_dims`` defaults
    to what cuDNN takes on this machine's GPU."""
    if head_dims is None:
        head_dims = HOPPER_HEAD_DIMS if hopper_or_later() else HEAD_DIMS
    if str(query.dtype) not in HALF_DTYPES:
        return f"cuDNN attention needs bfloat16 or float16, got {query.dtype}"
    d, dv = query.shape[-1], value.shape[-1]
    if d not in head_dims or dv != d:
        return f"cuDNN attention here serves head dims {_describe(head_dims)} with Dv == D, got D={d}, Dv={dv}"
    return None


def heuristic_cfg(inv: Any, stage: str) -> FwdParams | BwdParams:
    return FwdParams() if stage == "fwd" else BwdParams()  # cuDNN picks its own launch parameters


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window_size: tuple[int, int] | None = None,
) -> jax.Array:
    """``jax.nn.dot_product_attention`` on cuDNN: the one place ejkernel calls cuDNN's fused attention."""
    return jax.nn.dot_product_attention(
        query,
        key,
        value,
        bias,
        mask,
        scale=scale,
        is_causal=is_causal,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size,
        implementation="cudnn",
    )


def supports(inv: Any) -> str | None:
    """None when the cuDNN path can serve the (normalized) call ``inv``, else why not. Pure logic on shapes and options."""
    a = inv.arguments
    q, k, v = a["query"], a["key"], a["value"]
    reason = unsupported_inputs(q, v)
    if reason is not None:
        return reason
    t, s = q.shape[1], k.shape[1]
    if a.get("mask") is not None:
        return "mask is not served by the cuDNN path (cuDNN adds it as a bias: a row it masks whole would average the values, not give zeros)"
    bias = a.get("bias")
    if bias is not None and str(bias.dtype) != str(q.dtype):
        return f"the cuDNN path takes a bias in the query's dtype {q.dtype}, got {bias.dtype}"
    # jax 0.11 hands cuDNN a causal mask as a bias, so the even-length rule applies there too (seen on the
    # H200 with T = S = 1031: "Unsupported sequence length Q 1031, KV 1031").
    if (bias is not None or a.get("is_causal")) and (t % 2 or s % 2):
        what = "a bias" if bias is not None else "is_causal (jax passes it as a bias)"
        return f"the cuDNN path serves {what} only with even T and S (for its gradient), got T={t}, S={s}"
    window = a.get("local_window_size")
    if window is not None:
        left, right = (window, window) if isinstance(window, int) else window
        if right != 0 and not a.get("is_causal"):
            return f"the cuDNN path serves local_window_size only without a right side (right 0 or is_causal), got {window!r}"
        if t > s + left:
            return f"local_window_size={window!r} with T={t} > S + left={s + left} leaves query rows without keys; not served by the cuDNN path"
    return None


def scaled_dot_product_attention(
    query, key, value, bias=None, mask=None, *, scale=None, is_causal=False, query_seq_lengths=None,
    key_value_seq_lengths=None, local_window_size=None, fwd_params=None, bwd_params=None,
):  # fmt: skip
    """``scaled_dot_product_attention`` on cuDNN (only what ``supports`` admits reaches here)."""
    t, s = query.shape[1], key.shape[1]
    if bias is not None:
        bias = jnp.broadcast_to(bias, (*bias.shape[:2], t, s))  # cuDNN takes [B|1, N|1, T, S]
    q_len = None if query_seq_lengths is None else jnp.asarray(query_seq_lengths, jnp.int32)
    kv_len = None if key_value_seq_lengths is None else jnp.asarray(key_value_seq_lengths, jnp.int32)
    window = normalize_window(local_window_size)
    if window is not None and is_causal:
        window = (window[0], 0)
    out = dot_product_attention(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal, query_seq_lengths=q_len,
        key_value_seq_lengths=kv_len, local_window_size=window,
    )  # fmt: skip
    if q_len is not None:  # the contract's zeros on padded query rows, whatever cuDNN leaves there
        out = jnp.where((jnp.arange(t) < q_len[:, None])[:, :, None, None], out, jnp.zeros((), out.dtype))
    return out
