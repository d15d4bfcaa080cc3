"""``flash_attention_block`` / ``flash_attention_block_bwd``: the attention-block contract's public functions,
``Kernel`` subclasses and configs (the contract: ``ejkernel.kernels.signatures.flash_attention_block``).

Schedules (``ejkernel.schedules``: ring attention) call these, so the fastest installed block
implementation runs under them; each of the two ops has its own config chain (implementation, launch
parameters, autotuning, caches).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ejkernel.kernels.signatures.flash_attention import normalize_window
from ejkernel.kernels.signatures.flash_attention_block import default_positions
from ejkernel.modules.operations._dispatch import dispatch
from ejkernel.ops import Invocation, Kernel
from ejkernel.ops.config.base import BaseOperationConfig


@dataclasses.dataclass(frozen=True)
class FlashAttentionBlockConfig(BaseOperationConfig):
    """Config of ``flash_attention_block``: ``platform``, ``backend``, ``fwd_params`` (the forward kernel's)."""


@dataclasses.dataclass(frozen=True)
class FlashAttentionBlockBwdConfig(BaseOperationConfig):
    """Config of ``flash_attention_block_bwd``: ``platform``, ``backend`` and, as its ``fwd_params`` (the op's
    one stage), the backward kernel's launch parameters (``BwdParams`` for the XLA and Triton implementations)."""


def _normalize(arguments: dict[str, Any]) -> dict[str, Any]:
    d = arguments["query"].shape[-1]
    arguments["sliding_window"] = normalize_window(arguments["sliding_window"])
    arguments["softmax_scale"] = float(d**-0.5 if arguments["softmax_scale"] is None else arguments["softmax_scale"])
    if arguments["logits_soft_cap"] is not None:
        arguments["logits_soft_cap"] = float(arguments["logits_soft_cap"])
    if not arguments["causal"] and arguments["sliding_window"] is None:
        # Positions only matter to causal/window masking: without it they must not decline or split anything.
        arguments["q_positions"] = arguments["kv_positions"] = None
    return arguments


def _timing_inputs(inputs: dict[str, Any], inv: Invocation) -> dict[str, Any]:
    """Representative positions for timing: those of ``flash_attention`` (bottom-right aligned)."""
    if isinstance(inv.arguments.get("q_positions"), jax.ShapeDtypeStruct):
        t, s = inv.arguments["query"].shape[1], inv.arguments["key"].shape[1]
        qpos, kpos = default_positions(t, s)
        inputs["q_positions"] = qpos.astype(inv.arguments["q_positions"].dtype)
        inputs["kv_positions"] = kpos.astype(inv.arguments["kv_positions"].dtype)
    return inputs


class FlashAttentionBlock(Kernel[FlashAttentionBlockConfig]):
    op_id = "flash_attention_block"
    config_type = FlashAttentionBlockConfig

    def normalize(self, arguments: dict[str, Any]) -> dict[str, Any]:
        return _normalize(arguments)

    def make_inputs(self, inv: Invocation, seed: int = 0) -> dict[str, Any]:
        return _timing_inputs(super().make_inputs(inv, seed), inv)

    def empty_result(self, arguments: Mapping[str, Any]) -> Any:
        b, t, h, _ = np.shape(arguments["query"])
        s, dv = np.shape(arguments["key"])[1], np.shape(arguments["value"])[-1]
        if math.prod((b, t, h)) and s:
            return None
        return jnp.zeros((b, t, h, dv), jnp.float32), jnp.full((b, h, t), -jnp.inf, jnp.float32)


class FlashAttentionBlockBwd(Kernel[FlashAttentionBlockBwdConfig]):
    op_id = "flash_attention_block_bwd"
    config_type = FlashAttentionBlockBwdConfig

    def normalize(self, arguments: dict[str, Any]) -> dict[str, Any]:
        return _normalize(arguments)

    def make_inputs(self, inv: Invocation, seed: int = 0) -> dict[str, Any]:
        inputs = _timing_inputs(super().make_inputs(inv, seed), inv)
        s = inv.arguments["key"].shape[1]
        inputs["lse"] = jnp.full(inv.arguments["lse"].shape, math.log(max(s, 1)), jnp.float32)  # P ~ 1/S
        return inputs

    def empty_result(self, arguments: Mapping[str, Any]) -> Any:
        q, k, v = (np.shape(arguments[n]) for n in ("query", "key", "value"))
        if math.prod(q) and math.prod(k) and math.prod(v):
            return None
        return jnp.zeros(q, jnp.float32), jnp.zeros(k, jnp.float32), jnp.zeros(v, jnp.float32)


_kernel = FlashAttentionBlock()
_bwd_kernel = FlashAttentionBlockBwd()

_ARRAYS = ("q_positions", "kv_positions", "q_segment_ids", "kv_segment_ids")


@dataclasses.dataclass(frozen=True)
class _Static:
    """The static part of a differentiable block call (the custom_vjp's non-differentiable argument)."""

    options: tuple[tuple[str, Any], ...]
    platform: str | None
    backend: str | None
    cfg: FlashAttentionBlockConfig | None
    bwd_cfg: FlashAttentionBlockBwdConfig | None


def _forward(static: _Static, q: Any, k: Any, v: Any, masks: dict[str, Any]) -> Any:
    arrays = {"query": q, "key": k, "value": v, **masks}
    where = dict(platform=static.platform, backend=static.backend, mesh=None, in_specs=None, out_specs=None)
    return dispatch(_kernel, arrays, dict(static.options), cfg=static.cfg, **where)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _block(static: _Static, q: Any, k: Any, v: Any, masks: dict[str, Any]) -> Any:
    return _forward(static, q, k, v, masks)


def _block_fwd(static: _Static, q: Any, k: Any, v: Any, masks: dict[str, Any]) -> Any:
    out, lse = _forward(static, q, k, v, masks)
    return (out, lse), (q, k, v, masks, out, lse)


def _block_bwd(static: _Static, res: Any, g: Any) -> Any:
    q, k, v, masks, out, lse = res
    dout, dlse = g
    dq, dk, dv = flash_attention_block_bwd(
        q, k, v, out, lse, dout, dlse=dlse, **masks, **dict(static.options), platform=static.platform,
        backend=static.backend, cfg=static.bwd_cfg,
    )  # fmt: skip
    masks_ct = jax.tree.map(lambda _: None, masks)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), masks_ct


_block.defvjp(_block_fwd, _block_bwd)


def flash_attention_block(
    query: Float[Array, "B T H D"],
    key: Float[Array, "B S K D"],
    value: Float[Array, "B S K Dv"],
    *,
    q_positions: Int[Array, "T"] | None = None,
    kv_positions: Int[Array, "S"] | None = None,
    q_segment_ids: Int[Array, "B T"] | None = None,
    kv_segment_ids: Int[Array, "B S"] | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    platform: str | None = None,
    backend: str | None = None,
    cfg: FlashAttentionBlockConfig | None = None,
    bwd_cfg: FlashAttentionBlockBwdConfig | None = None,
) -> tuple[Float[Array, "B T H Dv"], Float[Array, "B H T"]]:
    """Attention of a block of queries against one block of keys/values: the partial result ``(out, lse)``.

    The building block of chunked schedules (ring attention): partial results over disjoint key blocks
    merge by log-sum-exp (``ejkernel.kernels.signatures.flash_attention_block.combine``). Read the contract
    (``ejkernel.kernels.signatures.flash_attention_block``) for the exact semantics.

    Args:
        query: ``[B, T, H, D]``.
        key: ``[B, S, K, D]`` (H % K == 0).
        value: ``[B, S, K, Dv]``.
        q_positions, kv_positions: ``[T]``/``[S]`` non-decreasing int positions for causal/window masking
            (both or neither; default ``flash_attention``'s bottom-right alignment).
        q_segment_ids, kv_segment_ids: ``[B, T]``/``[B, S]`` ints; attend only within equal ids.
        softmax_scale: default ``D ** -0.5``.
        causal: key positions ``<=`` the query's.
        sliding_window: ``(left, right)`` around the query's position, or ``w`` for ``(w, w)``.
        logits_soft_cap: ``cap * tanh(scores / cap)`` before masking.
        platform, backend: restrict the implementation (as every op).
        cfg: overrides the forward's config chain; ``bwd_cfg`` the backward op's (when differentiated).

    Returns:
        ``out [B, T, H, Dv]`` float32 (zeros on rows that admit no key) and ``lse [B, H, T]`` float32
        (``-inf`` there). Differentiable in ``query``, ``key`` and ``value`` through both outputs, by reverse
        mode: the backward is the op ``flash_attention_block_bwd``.

    >>> import jax.numpy as jnp
    >>> q = jnp.zeros((1, 4, 2, 8)); k = v = jnp.ones((1, 6, 1, 8))  # every score 0: lse = log(#keys)
    >>> out, lse = flash_attention_block(q, k, v, causal=True, q_positions=jnp.arange(4) + 10,
    ...                                  kv_positions=jnp.arange(6) + 8)  # keys 8..13, queries 10..13
    >>> out.dtype, lse.shape, [round(float(x), 3) for x in jnp.exp(lse[0, 0])]  # 3, 4, 5, 6 keys admitted
    (dtype('float32'), (1, 2, 4), [3.0, 4.0, 5.0, 6.0])
    """
    masks = {
        "q_positions": q_positions,
        "kv_positions": kv_positions,
        "q_segment_ids": q_segment_ids,
        "kv_segment_ids": kv_segment_ids,
    }
    options = (
        ("softmax_scale", softmax_scale),
        ("causal", causal),
        ("sliding_window", sliding_window if not isinstance(sliding_window, list) else tuple(sliding_window)),
        ("logits_soft_cap", logits_soft_cap),
    )
    return _block(_Static(options, platform, backend, cfg, bwd_cfg), query, key, value, masks)


def flash_attention_block_bwd(
    query: Float[Array, "B T H D"],
    key: Float[Array, "B S K D"],
    value: Float[Array, "B S K Dv"],
    out: Float[Array, "B T H Dv"],
    lse: Float[Array, "B H T"],
    dout: Float[Array, "B T H Dv"],
    *,
    dlse: Float[Array, "B H T"] | None = None,
    q_positions: Int[Array, "T"] | None = None,
    kv_positions: Int[Array, "S"] | None = None,
    q_segment_ids: Int[Array, "B T"] | None = None,
    kv_segment_ids: Int[Array, "B S"] | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    platform: str | None = None,
    backend: str | None = None,
    cfg: FlashAttentionBlockBwdConfig | None = None,
) -> tuple[Float[Array, "B T H D"], Float[Array, "B S K D"], Float[Array, "B S K Dv"]]:
    """This key block's share ``(dq, dk, dv)`` (float32) of the gradients, from the rows' *global* ``out``/``lse``.

    ``out``/``lse``: the rows' result over every key block of the schedule (a ring's final output and
    log-sum-exp); ``dout``: the cotangent of ``out``; ``dlse``: that of ``lse``, when it is differentiated
    too. Summing ``dq`` over the key blocks, and taking each block's ``dk``/``dv``, gives the gradients of the
    whole attention. The options and masks are the forward's (see :func:`flash_attention_block`). Not
    differentiable itself.
    """
    arrays = {
        "query": query,
        "key": key,
        "value": value,
        "out": out,
        "lse": lse,
        "dout": dout,
        "dlse": dlse,
        "q_positions": q_positions,
        "kv_positions": kv_positions,
        "q_segment_ids": q_segment_ids,
        "kv_segment_ids": kv_segment_ids,
    }
    options = {
        "softmax_scale": softmax_scale,
        "causal": causal,
        "sliding_window": sliding_window,
        "logits_soft_cap": logits_soft_cap,
    }
    return dispatch(
        _bwd_kernel,
        arrays,
        options,
        platform=platform,
        backend=backend,
        cfg=cfg,
        mesh=None,
        in_specs=None,
        out_specs=None,
    )


__all__ = [
    "FlashAttentionBlock",
    "FlashAttentionBlockBwd",
    "FlashAttentionBlockBwdConfig",
    "FlashAttentionBlockConfig",
    "flash_attention_block",
    "flash_attention_block_bwd",
]
