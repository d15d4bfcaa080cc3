"""Ring attention, written once: keys/values travel round a mesh axis, each step one attention block.

Every device keeps its queries and, at ring step ``r``, holds the key/value shard of device
``src = (me - r) mod n`` (step 0: its own). It attends its queries to that shard with the block contract
(``flash_attention_block``: the partial ``(out, lse)`` of the shard, float32), merges that into its running
result by log-sum-exp (``combine``), and passes the shard on with ``lax.ppermute`` (device i sends to i + 1;
the send overlaps the step's compute where the backend runs collectives asynchronously). The last step sends
nothing: every shard has then been seen.

Masking a step: causal/window masking on global positions. Under every layout the positions of a shard
increase with the local index, so the block contract's ``q_positions``/``kv_positions`` are the layout's
``global_positions`` of the local queries (shifted by ``n*S - n*T``: the bottom-right alignment of the whole
sequence) and of the visiting keys. Segment ids travel with the keys. A step that causal/window masking
leaves empty (``key_intervals``) is skipped whole (``lax.cond``): under a contiguous causal ring device r
computes only r + 1 of the n steps (the last device still computes all of them and bounds the time); the
zigzag/striped layouts give every device the same work at every step.

Backward (``jax.custom_vjp``, residuals: the inputs, ``out`` and ``lse`` only): a second ring. With the final
``out``/``lse``, every shard pair's gradients are independent (``flash_attention_block_bwd``), so each step adds
the visiting shard's ``dK``/``dV`` into float32 accumulators that travel with that shard's keys/values; after
``n`` steps each accumulator is back on the device that owns the shard (the last step sends only them). ``dQ``
accumulates locally. Memory is O(T + S) per device: no ``T x S`` array, no gathered sequence (given a block
implementation of O(T) memory).

Launch parameters: the ring has none of its own. Each block op resolves its own through its config chain
(autotuned on its own, since a block call has no collective); a ``cfg=`` of ``ring_attention`` with
``fwd_params``/``bwd_params`` overrides the block forward's / block backward's.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ejkernel.kernels.params import LaunchParams
from ejkernel.kernels.signatures._attention import combine, key_intervals, normalize_window
from ejkernel.modules.operations.ring_attention import check_layout, global_positions, ring_axis_size

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class RingOptions:
    """Static (hashable) options of one ring call."""

    scale: float
    causal: bool = False
    window: tuple[int, int] | None = None
    soft_cap: float | None = None
    axis_name: str | None = None
    layout: str = "contiguous"
    fwd_params: LaunchParams | None = None  # overrides of the block ops' launch parameters (None: their chains)
    bwd_params: LaunchParams | None = None

    @property
    def masked(self) -> bool:
        """Whether causal/window masking (on positions) applies."""
        return self.causal or self.window is not None

    def block_options(self) -> dict[str, Any]:
        return {
            "softmax_scale": self.scale,
            "causal": self.causal,
            "sliding_window": self.window,
            "logits_soft_cap": self.soft_cap,
        }


def ring_info(o: RingOptions) -> tuple[int, jax.Array]:
    """``(n, me)``: the ring's size and this device's place on it (``(1, 0)`` without an axis)."""
    n = ring_axis_size(o.axis_name)
    me = lax.axis_index(o.axis_name) if o.axis_name is not None else jnp.int32(0)
    return n, jnp.asarray(me, jnp.int32)


def step_positions(o: RingOptions, n: int, me: Any, src: Any, t: int, s: int) -> tuple[jax.Array, jax.Array]:
    """The block contract's ``(q_positions, kv_positions)`` of this device's queries against shard ``src``."""
    kpos = global_positions(o.layout, n, src, s, jnp)
    qpos = global_positions(o.layout, n, me, t, jnp) + n * (s - t)  # bottom-right aligned diagonal
    return qpos.astype(jnp.int32), kpos.astype(jnp.int32)


def step_bounds(o: RingOptions, n: int, me: Any, src: Any, t: int, s: int) -> tuple[jax.Array, jax.Array]:
    """Per local query row, the local keys ``[lo, hi)`` of shard ``src`` that causal/window masking admits."""
    if not o.masked:
        return jnp.zeros((t,), jnp.int32), jnp.full((t,), s, jnp.int32)
    qpos, kpos = step_positions(o, n, me, src, t, s)
    return key_intervals(qpos, kpos, t, s, causal=o.causal, window=o.window)


def _rotate(x: Any, o: RingOptions, n: int) -> Any:
    """Pass ``x`` (a pytree) to the next device of the ring."""
    if n == 1:
        return x
    return lax.ppermute(x, o.axis_name, [(i, (i + 1) % n) for i in range(n)])


def _if_admitted(o: RingOptions, n: int, me: Any, src: Any, t: int, s: int, fn: Any, carry: Any) -> Any:
    """``fn(carry)``, skipped (``carry`` unchanged) when causal/window masking admits no pair of the step."""
    if not o.masked:
        return fn(carry)
    lo, hi = step_bounds(o, n, me, src, t, s)
    return lax.cond(jnp.any(lo < hi), fn, lambda c: c, carry)


def _block_cfgs(o: RingOptions) -> tuple[Any, Any]:
    from ejkernel.modules.operations.flash_attention_block import (
        FlashAttentionBlockBwdConfig,
        FlashAttentionBlockConfig,
    )

    fwd = None if o.fwd_params is None else FlashAttentionBlockConfig(fwd_params=o.fwd_params)
    bwd = None if o.bwd_params is None else FlashAttentionBlockBwdConfig(fwd_params=o.bwd_params)
    return fwd, bwd


# ---- forward --------------------------------------------------------------------------------------


def forward(o: RingOptions, q: jax.Array, k: jax.Array, v: jax.Array, qseg: Any, kvseg: Any) -> tuple[Any, Any]:
    """``(out [B, T, H, Dv] in query.dtype, lse [B, H, T] float32)`` of this device's queries."""
    from ejkernel.modules.operations.flash_attention_block import flash_attention_block

    n, me = ring_info(o)
    B, T, H, _ = q.shape
    S, Dv = k.shape[1], v.shape[-1]
    fwd_cfg, _ = _block_cfgs(o)

    def attend(src: Any, kv: tuple[Any, Any, Any], acc: tuple[Any, Any]) -> tuple[Any, Any]:
        """Merge the partial result of shard ``src`` (keys/values/segment ids ``kv``) into ``acc``."""

        def add(acc: tuple[Any, Any]) -> tuple[Any, Any]:
            ks, vs, kvs = kv
            positions = step_positions(o, n, me, src, T, S) if o.masked and n > 1 else (None, None)
            out_r, lse_r = flash_attention_block(
                q, ks, vs, q_positions=positions[0], kv_positions=positions[1], q_segment_ids=qseg,
                kv_segment_ids=kvs, **o.block_options(), cfg=fwd_cfg,
            )  # fmt: skip
            return combine(*acc, out_r.astype(F32), lse_r.astype(F32))

        return _if_admitted(o, n, me, src, T, S, add, acc)

    acc = (jnp.zeros((B, T, H, Dv), F32), jnp.full((B, H, T), -jnp.inf, F32))
    kv = (k, v, kvseg)
    if n > 1:

        def ring_step(r: Any, carry: Any) -> Any:
            acc, kv = carry
            acc = attend((me - r) % n, kv, acc)
            return acc, _rotate(kv, o, n)

        acc, kv = lax.fori_loop(0, n - 1, ring_step, (acc, kv))
    out, lse = attend((me - (n - 1)) % n, kv, acc)  # the last step: nothing left to send
    return out.astype(q.dtype), lse


# ---- backward -------------------------------------------------------------------------------------


def backward(o: RingOptions, res: tuple[Any, ...], dout: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(dq, dk, dv)`` of this device's shards, by a second ring in which dK/dV travel with their K/V."""
    from ejkernel.modules.operations.flash_attention_block import flash_attention_block_bwd

    q, k, v, qseg, kvseg, out, lse = res
    n, me = ring_info(o)
    T, S = q.shape[1], k.shape[1]
    _, bwd_cfg = _block_cfgs(o)
    dout = dout.astype(q.dtype)

    def attend(src: Any, kv: tuple[Any, Any, Any], acc: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
        """Add shard ``src``'s part to ``dq`` and its ``dk``/``dv`` to the accumulators (``acc``)."""

        def add(acc: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
            ks, vs, kvs = kv
            positions = step_positions(o, n, me, src, T, S) if o.masked and n > 1 else (None, None)
            grads = flash_attention_block_bwd(
                q, ks, vs, out, lse, dout, q_positions=positions[0], kv_positions=positions[1],
                q_segment_ids=qseg, kv_segment_ids=kvs, **o.block_options(), cfg=bwd_cfg,
            )  # fmt: skip
            dq, dk, dv = (a + g.astype(F32) for a, g in zip(acc, grads, strict=True))
            return dq, dk, dv

        return _if_admitted(o, n, me, src, T, S, add, acc)

    dq = jnp.zeros(q.shape, F32)
    dk, dv = jnp.zeros(k.shape, F32), jnp.zeros(v.shape, F32)
    kv = (k, v, kvseg)
    if n > 1:

        def ring_step(r: Any, carry: Any) -> Any:
            dq, kv, dkv = carry
            dq, *dkv = attend((me - r) % n, kv, (dq, *dkv))
            return dq, *_rotate((kv, tuple(dkv)), o, n)

        dq, kv, (dk, dv) = lax.fori_loop(0, n - 1, ring_step, (dq, kv, (dk, dv)))
    dq, dk, dv = attend((me - (n - 1)) % n, kv, (dq, dk, dv))
    # The shard's dK/dV were last on the device before its owner: one more pass brings them home.
    dk, dv = _rotate((dk, dv), o, n)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


# ---- custom_vjp -----------------------------------------------------------------------------------


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def ring(o: RingOptions, q: Any, k: Any, v: Any, qseg: Any, kvseg: Any) -> Any:
    """Ring attention; differentiable in ``q``, ``k`` and ``v`` (segment ids get no cotangent)."""
    return forward(o, *_arrays((q, k, v, qseg, kvseg)))[0]


def _arrays(arrays: tuple[Any, ...]) -> tuple[Any, ...]:
    """NumPy inputs (``jax.test_util.check_grads`` passes them) as JAX arrays, so tracers can index them."""
    return tuple(None if x is None else jnp.asarray(x) for x in arrays)


def _ring_fwd(o: RingOptions, *primals: Any) -> tuple[jax.Array, Any]:
    arrays = _arrays(primals)
    out, lse = forward(o, *arrays)
    return out, (*arrays, out, lse)


def _ring_bwd(o: RingOptions, res: Any, g: Any) -> tuple[Any, ...]:
    dq, dk, dv = backward(o, res, jnp.asarray(g))
    return (dq, dk, dv, None, None)


ring.defvjp(_ring_fwd, _ring_bwd)


# ---- the implementation of the op ``ring_attention`` ----------------------------------------------


def ring_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    axis_name: str | None = None,
    layout: str = "contiguous",
    fwd_params: LaunchParams | None = None,
    bwd_params: LaunchParams | None = None,
) -> jax.Array:
    """Ring attention (contract: ``ejkernel.modules.operations.ring_attention``) on the block contract.

    ``fwd_params``/``bwd_params``: when set, the launch parameters of every block forward / block backward
    (``flash_attention_block``'s / ``flash_attention_block_bwd``'s, e.g. ``q_blocksize``/``kv_blocksize``);
    None: each block op's own config chain decides.
    """
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("ring_attention: pass both q_segment_ids and kv_segment_ids, or neither")
    n = ring_axis_size(axis_name)
    check_layout(layout, n, query.shape[1], "the local query length T")
    check_layout(layout, n, key.shape[1], "the local key length S")
    opts = RingOptions(
        scale=float(query.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale),
        causal=bool(causal),
        window=normalize_window(sliding_window),
        soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        axis_name=axis_name,
        layout=layout if n > 1 else "contiguous",
        fwd_params=fwd_params,
        bwd_params=bwd_params,
    )
    return ring(opts, query, key, value, q_segment_ids, kv_segment_ids)


def heuristic_cfg(inv: Any, stage: str) -> None:
    """No launch parameters of the ring's own: the block ops choose theirs (see the module docstring)."""
    return None


def candidate_cfgs(inv: Any, stage: str) -> list[Any]:
    """Nothing to time at the ring's level: the block ops are tuned on their own (they have no collective)."""
    return []


__all__ = [
    "RingOptions",
    "backward",
    "candidate_cfgs",
    "forward",
    "heuristic_cfg",
    "ring",
    "ring_attention",
    "step_bounds",
    "step_positions",
]
