"""The attention-block contract: ``flash_attention_block`` (forward) and ``flash_attention_block_bwd`` (backward).

The FlashAttention-2 pieces a chunked schedule (a ring, a split of the keys) is written in: the attention of
a block of queries against *one* block of keys/values, as a partial result ``(out, lse)`` that partial
results over other key blocks merge with by log-sum-exp (``combine`` in ``ejkernel.kernels.signatures._attention``), and a backward per block that takes
the *global* ``out``/``lse`` of the rows (over every key block), so that each block's gradients are
independent and simply add up. A schedule calls both through the core's dispatch, so the fastest installed
implementation of each runs (each op has its own config chain).

Shapes: B batch, T queries of the block, S keys of the block, H query heads, K key/value heads (H % K == 0;
query head h reads kv head h // (H // K)), D query/key head dim, Dv value head dim.

Which keys a query admits. Every query and key has a *position* (int32): ``q_positions [T]`` and
``kv_positions [S]``, both **non-decreasing** (checked when concrete; implementations rely on it: the keys
a row admits are one interval). Without them (both None) the positions are those of ``flash_attention``:
``q_positions[i] = i + S - T`` and ``kv_positions[j] = j`` (bottom-right aligned). Key j is admitted by
query i unless masked by

- ``causal``: ``kv_positions[j] <= q_positions[i]``;
- ``sliding_window=(left, right)`` (an int ``w`` means ``(w, w)``):
  ``q_positions[i] - left <= kv_positions[j] <= q_positions[i] + right``;
- segment ids (when given, both): ``q_segment_ids[b, i] == kv_segment_ids[b, j]``.

The positions only matter with ``causal`` or ``sliding_window`` (pass None otherwise). A schedule gives
global positions, e.g. a ring step over the shard of device ``src``: the layout's global positions of the
local queries (shifted by ``n*S - n*T`` for the bottom-right alignment) and of the visiting keys.

Forward, per row: ``s = softmax_scale * q_i . k_j`` (default scale ``D ** -0.5``), ``s = logits_soft_cap *
tanh(s / logits_soft_cap)``, masking, softmax over the admitted keys in float32. Returns

- ``out [B, T, H, Dv]`` **float32** (whatever the input dtype: partial results are merged in float32 and
  the schedule rounds once, at the end); zeros on a row that admits no key of the block;
- ``lse [B, H, T]`` float32: the natural log of the softmax denominator, ``-inf`` on a row that admits no key.

Backward: given the row's **global** ``out`` (any float dtype) and ``lse`` (float32, ``-inf`` where the row
admits no key anywhere) and the cotangent ``dout`` of ``out``, with ``P = exp(s - lse)`` on this block's
admitted keys and ``delta = rowsum(dout * out)`` (minus ``dlse`` when the log-sum-exp is differentiated too:
``dS = P * (dP - delta + dlse)``), it returns this block's share of the gradients, **float32**:
``dq [B, T, H, D]``, ``dk [B, S, K, D]``, ``dv [B, S, K, Dv]`` (dk/dv summed over the query heads of each
kv head). Summing ``dq`` over every key block (and taking each block's ``dk``/``dv``) gives the gradients of
the whole attention.

The launch parameters of ``flash_attention_block_bwd`` are its backward kernel's: it is an op of its own,
so an implementation takes them as its ``fwd_params`` (stage ``fwd`` of that op; the XLA and Triton
implementations register ``BwdParams`` as that class).

Schedules (``ejkernel.schedules``: ring attention) call the public functions below, so the fastest installed
block implementation runs under them. The two ops are defined here once: this contract, ``validate`` and
``validate_bwd``, the ``Kernel`` subclasses, the configs and the public functions, whose parameters are the
canonical signatures (``ejkernel.kernels.signatures.canonical_signature``). The masks and options are spelled
once, in :func:`flash_attention_block`; the backward takes the same ones.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Mapping
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ejkernel.kernels.signatures import DISPATCH_ONLY
from ejkernel.kernels.signatures._attention import default_positions, normalize_window
from ejkernel.kernels.signatures._checks import (
    ArrayIn,
    check_bool,
    check_query_key_value,
    check_scale,
    check_segment_ids,
    check_soft_cap,
    check_values,
    check_window,
    describe,
    first,
    is_int_array,
    shape,
)
from ejkernel.modules.operations._dispatch import dispatch
from ejkernel.modules.operations._typecheck import checked
from ejkernel.ops import Invocation, Kernel
from ejkernel.ops.config.base import BaseOperationConfig

OP = "flash_attention_block"
OP_BWD = "flash_attention_block_bwd"
MASKS = ("q_positions", "kv_positions", "q_segment_ids", "kv_segment_ids")
"""The keyword arguments of the block ops that are arrays (the other options are static)."""


def _check_positions(op: str, q_positions: Any, kv_positions: Any, t: int, s: int) -> None:
    if (q_positions is None) != (kv_positions is None):
        raise ValueError(f"{op}: pass both q_positions and kv_positions, or neither")
    if q_positions is None:
        return
    for name, x, n in (("q_positions", q_positions, t), ("kv_positions", kv_positions, s)):
        if shape(x) != (n,) or not is_int_array(x):
            raise ValueError(f"{op}: {name} must be an integer array of shape [{n}], got {describe(x)}")

        def sorted_(p: np.ndarray, name: str = name) -> None:
            at = first(np.diff(np.asarray(p).astype(np.int64)) < 0)
            if at is not None:
                i = at[0] + 1
                raise ValueError(
                    f"{op}: {name} must be non-decreasing, got {name}[{i}] = {p[i]} after {name}[{i - 1}] = {p[i - 1]}"
                )

        check_values(sorted_, x)


def _check_masks_and_options(op: str, b: int, t: int, s: int, options: Mapping[str, Any]) -> None:
    """The checks both block ops share: the forward's masks and options (absent ones at their defaults)."""
    _check_positions(op, options.get("q_positions"), options.get("kv_positions"), t, s)
    check_segment_ids(op, options.get("q_segment_ids"), options.get("kv_segment_ids"), b, t, s)
    check_scale(op, "softmax_scale", options.get("softmax_scale"))
    check_bool(op, "causal", options.get("causal", False))
    check_window(op, "sliding_window", options.get("sliding_window"))
    check_soft_cap(op, options.get("logits_soft_cap"))


def validate(query: Any, key: Any, value: Any, **options: Any) -> None:
    """Check a ``flash_attention_block`` call; raise an error naming the argument, what was expected and what came."""
    q, k = check_query_key_value(OP, query, key, value)
    _check_masks_and_options(OP, q[0], q[1], k[1], options)


def validate_bwd(query: Any, key: Any, value: Any, out: Any, lse: Any, dout: Any, **options: Any) -> None:
    """Check a ``flash_attention_block_bwd`` call (the forward's checks, plus ``out``, ``lse``, ``dout``, ``dlse``)."""
    q, k = check_query_key_value(OP_BWD, query, key, value)
    b, t, h, s, dv = q[0], q[1], q[2], k[1], shape(value)[-1]
    for name, x, want in (("out", out, (b, t, h, dv)), ("dout", dout, (b, t, h, dv)), ("lse", lse, (b, h, t))):
        if shape(x) != want or not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{OP_BWD}: {name} must be a float array of shape {list(want)}, got {describe(x)}")
    dlse = options.pop("dlse", None)
    if dlse is not None and (shape(dlse) != (b, h, t) or not jnp.issubdtype(dlse.dtype, jnp.floating)):
        raise ValueError(f"{OP_BWD}: dlse must be a float array of shape {[b, h, t]}, got {describe(dlse)}")
    _check_masks_and_options(OP_BWD, b, t, s, options)


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


@checked
def flash_attention_block(
    query: Float[ArrayIn, "B T H D"],
    key: Float[ArrayIn, "B S K D"],
    value: Float[ArrayIn, "B S K Dv"],
    *,
    q_positions: Int[ArrayIn, "T"] | None = None,
    kv_positions: Int[ArrayIn, "S"] | None = None,
    q_segment_ids: Int[ArrayIn, "B T"] | None = None,
    kv_segment_ids: Int[ArrayIn, "B S"] | None = None,
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
    merge by log-sum-exp (``ejkernel.kernels.signatures._attention.combine``). Read the contract (this module's
    docstring) for the exact semantics.

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
    masks = dict(zip(MASKS, (q_positions, kv_positions, q_segment_ids, kv_segment_ids), strict=True))
    options = (
        ("softmax_scale", softmax_scale),
        ("causal", causal),
        ("sliding_window", sliding_window if not isinstance(sliding_window, list) else tuple(sliding_window)),
        ("logits_soft_cap", logits_soft_cap),
    )
    return _block(_Static(options, platform, backend, cfg, bwd_cfg), query, key, value, masks)


@checked
def flash_attention_block_bwd(
    query: Float[ArrayIn, "B T H D"],
    key: Float[ArrayIn, "B S K D"],
    value: Float[ArrayIn, "B S K Dv"],
    out: Float[ArrayIn, "B T H Dv"],
    lse: Float[ArrayIn, "B H T"],
    dout: Float[ArrayIn, "B T H Dv"],
    *,
    dlse: Float[ArrayIn, "B H T"] | None = None,
    platform: str | None = None,
    backend: str | None = None,
    cfg: FlashAttentionBlockBwdConfig | None = None,
    **options: Any,
) -> tuple[Float[Array, "B T H D"], Float[Array, "B S K D"], Float[Array, "B S K Dv"]]:
    """This key block's share ``(dq, dk, dv)`` (float32) of the gradients, from the rows' *global* ``out``/``lse``.

    ``out``/``lse``: the rows' result over every key block of the schedule (a ring's final output and
    log-sum-exp); ``dout``: the cotangent of ``out``; ``dlse``: that of ``lse``, when it is differentiated
    too. Summing ``dq`` over the key blocks, and taking each block's ``dk``/``dv``, gives the gradients of the
    whole attention. ``options``: the forward's masks and options, by the same names and defaults (see
    :func:`flash_attention_block`; the signature lists them). Not differentiable itself.
    """
    arrays = {"query": query, "key": key, "value": value, "out": out, "lse": lse, "dout": dout, "dlse": dlse}
    arrays.update({name: options.pop(name) for name in MASKS if name in options})
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


def _takes_forward_options(fn: Any) -> None:
    """Spell ``fn``'s ``**options`` out in its signature as the forward's keyword options (between its own
    keywords and the dispatch ones), so that the canonical signature derived from it names each of them."""
    own = [p for p in inspect.signature(fn).parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    forward = [
        p
        for p in inspect.signature(flash_attention_block).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in DISPATCH_ONLY
    ]
    at = next(i for i, p in enumerate(own) if p.name in DISPATCH_ONLY)
    fn.__signature__ = inspect.signature(fn).replace(parameters=[*own[:at], *forward, *own[at:]])


_takes_forward_options(flash_attention_block_bwd)


__all__ = [
    "FlashAttentionBlock",
    "FlashAttentionBlockBwd",
    "FlashAttentionBlockBwdConfig",
    "FlashAttentionBlockConfig",
    "flash_attention_block",
    "flash_attention_block_bwd",
]
