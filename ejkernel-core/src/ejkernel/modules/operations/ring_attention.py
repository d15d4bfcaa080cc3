"""The ``ring_attention`` contract: ``flash_attention`` over a sequence sharded along a mesh axis.

Shapes: B batch, T local query length, S local key length, H query heads, K key/value heads
(H % K == 0; query head h reads kv head h // (H // K)), D query/key head dim, Dv value head dim,
n the size of the mesh axis ``axis_name``.

Inside a mapped axis (``jax.shard_map`` over a mesh with the axis ``axis_name``, or the public
function's ``mesh=``), every device holds ``T`` queries and ``S`` keys/values of a global sequence of
``n * T`` queries and ``n * S`` keys. The result on each device is exactly what ``flash_attention``
gives for its ``T`` queries on the whole (gathered) sequence, in the same order as the local queries:

1. ``s = softmax_scale * q_i . k_j`` (``softmax_scale`` defaults to ``D ** -0.5``);
2. ``s = logits_soft_cap * tanh(s / logits_soft_cap)``;
3. the key is masked out unless the segment ids are equal (when given) and, with ``p(i)``/``p(j)``
   the global positions below, ``causal``: ``p(j) <= p(i) + n*S - n*T`` (bottom-right aligned, as
   FlashAttention 2); ``sliding_window=(left, right)``: ``p(i) + n*S - n*T - left <= p(j) <=
   p(i) + n*S - n*T + right`` (an int ``w`` means ``(w, w)``);
4. softmax over the admitted keys in float32; a row with no admitted key gives zeros (never NaN);
5. ``out = P @ v`` in the dtype of ``query``.

Layouts: which global positions a device holds. Device ``r`` (``lax.axis_index(axis_name)``) holds,
for local index ``i`` of a length-``l`` shard (``l`` is T for queries, S for keys):

- ``"contiguous"``: ``p = r * l + i`` (shard r is the r-th slice of the sequence);
- ``"zigzag"``: ``l`` even, ``c = l // 2``; the sequence is cut into ``2n`` chunks of ``c`` and
  device r holds chunks ``r`` and ``2n - 1 - r``: ``p = r * c + i`` for ``i < c``, else
  ``(2n - 1 - r) * c + (i - c)``. With ``causal`` every device then has the same amount of work;
- ``"striped"``: ``p = i * n + r`` (every n-th token), also balanced under ``causal``.

Within every shard the positions increase with ``i``. The caller passes inputs already laid out
(``ejkernel.modules.ring_attention_layout`` permutes a whole sequence to and from a layout, so that
sharding it in contiguous slices gives each device its positions); the output uses the same layout.

With ``axis_name=None`` there is no ring: ``flash_attention`` of the local sequence (``n = 1``; the
layout then means nothing). A bias or dense attention mask over the global ``[n*T, n*S]`` does not
shard along the ring and is not supported; segment ids express packing (they travel with the keys).

The op is defined here once: this contract, ``validate``, the ``Kernel`` and the public function, whose
parameters are the canonical signature (``ejkernel.kernels.signatures.canonical_signature``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ejkernel.kernels.registry import Implementation
from ejkernel.kernels.signatures._attention import normalize_window
from ejkernel.kernels.signatures._checks import (
    ArrayIn,
    check_bool,
    check_query_key_value,
    check_scale,
    check_segment_ids,
    check_soft_cap,
    check_window,
)
from ejkernel.modules.operations._dispatch import dispatch
from ejkernel.modules.operations._empty import attention_zeros
from ejkernel.modules.operations._typecheck import checked
from ejkernel.modules.operations.configs import RingAttentionConfig
from ejkernel.ops import Invocation, Kernel

OP = "ring_attention"
LAYOUTS = ("contiguous", "zigzag", "striped")


def ring_axis_size(axis_name: str | None) -> int:
    """The size of the mapped axis ``axis_name`` (1 for None).

    Raises:
        ValueError: ``axis_name`` is not bound here (not inside ``shard_map`` over a mesh with that axis).
    """
    if axis_name is None:
        return 1
    from jax import lax

    try:
        return int(lax.axis_size(axis_name))
    except NameError:
        raise ValueError(
            f"ring_attention: axis_name {axis_name!r} is not bound here: call it inside jax.shard_map over a mesh "
            "with that axis, or pass mesh=, in_specs= and out_specs= (or axis_name=None for local attention)"
        ) from None


def check_layout(layout: Any, axis_size: int, length: int, what: str) -> None:
    """Refuse an unknown layout, or a length that the layout cannot split (``what`` names the length)."""
    if layout not in LAYOUTS:
        raise ValueError(f"ring_attention: layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    if layout == "zigzag" and axis_size > 1 and length % 2:
        raise ValueError(
            f'ring_attention: layout="zigzag" holds two chunks per device, so {what} must be even, got {length}'
        )


def global_positions(layout: str, axis_size: int, shard: Any, length: int, xp: Any = np) -> Any:
    """Global positions of the ``length`` local rows of device ``shard`` under ``layout`` (int32, increasing).

    ``xp`` is ``numpy`` or ``jax.numpy`` (then ``shard`` may be traced, e.g. ``lax.axis_index``).

    >>> global_positions("zigzag", 2, 0, 4).tolist(), global_positions("zigzag", 2, 1, 4).tolist()
    ([0, 1, 6, 7], [2, 3, 4, 5])
    >>> global_positions("striped", 2, 1, 3).tolist()
    [1, 3, 5]
    """
    i = xp.arange(length, dtype=xp.int32)
    shard = xp.asarray(shard).astype(xp.int32)
    if layout == "contiguous":
        return shard * length + i
    if layout == "zigzag":
        c = length // 2
        return xp.where(i < c, shard * c + i, (2 * axis_size - 1 - shard) * c + (i - c))
    if layout == "striped":
        return i * axis_size + shard
    raise ValueError(f"ring_attention: layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")


def layout_permutation(layout: str, axis_size: int, length: int) -> np.ndarray:
    """Indices ``perm`` such that ``x[perm]`` lays a whole sequence of ``length`` out for ``axis_size`` devices.

    Device ``r``'s contiguous slice ``[r * length // axis_size, (r + 1) * length // axis_size)`` of the
    laid-out sequence holds exactly its ``global_positions``.

    Raises:
        ValueError: an unknown layout, or ``length`` not a multiple of ``axis_size`` (of ``2 * axis_size``
        for zigzag).
    """
    if not isinstance(axis_size, int | np.integer) or axis_size < 1:
        raise ValueError(f"ring_attention: axis_size must be a positive int, got {axis_size!r}")
    check_layout(layout, 1, 0, "")
    if length % axis_size:
        raise ValueError(
            f"ring_attention: the sequence length {length} must be a multiple of the axis size {axis_size}"
        )
    check_layout(layout, axis_size, length // axis_size, f"the local length (sequence length {length} / {axis_size})")
    local = length // axis_size
    return np.concatenate([global_positions(layout, axis_size, r, local) for r in range(axis_size)]).astype(np.int64)


def validate(
    query: Any,
    key: Any,
    value: Any,
    *,
    q_segment_ids: Any = None,
    kv_segment_ids: Any = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    axis_name: str | None = None,
    layout: str = "contiguous",
    **_: Any,
) -> None:
    """Check a ``ring_attention`` call; raise an error naming the argument, what was expected and what came.

    Besides shapes and options it checks that ``axis_name`` is bound where the call is traced.
    """
    q, k = check_query_key_value(OP, query, key, value)
    b, t, s = q[0], q[1], k[1]
    check_segment_ids(OP, q_segment_ids, kv_segment_ids, b, t, s)
    check_scale(OP, "softmax_scale", softmax_scale)
    check_bool(OP, "causal", causal)
    check_window(OP, "sliding_window", sliding_window)
    check_soft_cap(OP, logits_soft_cap)
    if axis_name is not None and not isinstance(axis_name, str):
        raise TypeError(f"{OP}: axis_name must be a mesh axis name (str) or None, got {axis_name!r}")
    n = ring_axis_size(axis_name)
    check_layout(layout, n, t, "the local query length T")
    check_layout(layout, n, s, "the local key length S")


class RingAttention(Kernel[RingAttentionConfig]):
    op_id = "ring_attention"
    config_type = RingAttentionConfig

    def normalize(self, arguments: dict[str, Any]) -> dict[str, Any]:
        d = arguments["query"].shape[-1]
        arguments["sliding_window"] = normalize_window(arguments["sliding_window"])
        arguments["softmax_scale"] = float(
            d**-0.5 if arguments["softmax_scale"] is None else arguments["softmax_scale"]
        )
        if arguments["logits_soft_cap"] is not None:
            arguments["logits_soft_cap"] = float(arguments["logits_soft_cap"])
        if arguments["axis_name"] is None:
            arguments["layout"] = "contiguous"  # one shard: every layout is the identity
        return arguments

    def candidate_cfgs(self, inv: Invocation, impl: Implementation, stage: str) -> list[Any]:
        # The autotuner times candidates on concrete inputs outside any shard_map, where the ring's
        # collectives have no axis: with an axis there is nothing it can time, so the heuristic decides.
        if inv.arguments.get("axis_name") is not None:
            return []
        return super().candidate_cfgs(inv, impl, stage)

    def empty_result(self, arguments: Mapping[str, Any]) -> Any:
        return attention_zeros(arguments)  # no queries, or no keys: rows that admit no key give zeros


_kernel = RingAttention()


@checked
def ring_attention(
    query: Float[ArrayIn, "B T H D"],
    key: Float[ArrayIn, "B S K D"],
    value: Float[ArrayIn, "B S K Dv"],
    *,
    q_segment_ids: Int[ArrayIn, "B T"] | None = None,
    kv_segment_ids: Int[ArrayIn, "B S"] | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    axis_name: str | None = None,
    layout: str = "contiguous",
    platform: str | None = None,
    backend: str | None = None,
    cfg: RingAttentionConfig | None = None,
    mesh: jax.sharding.Mesh | None = None,
    in_specs: Any = None,
    out_specs: Any = None,
) -> Float[Array, "B T H Dv"]:
    """Attention over a sequence sharded along the mesh axis ``axis_name``: keys/values travel round a ring.

    Shapes (per device): B batch, T local query length, S local key length, H query heads, K key/value
    heads (H % K == 0), D head dim, Dv value head dim; n devices along ``axis_name`` hold a sequence of
    ``n * T`` queries and ``n * S`` keys. Each device's result equals ``flash_attention`` of its queries
    on the whole sequence (see ``ejkernel.modules.operations.ring_attention`` for the exact semantics).

    Call it with ``mesh``/``in_specs``/``out_specs`` (the sequence axis of the specs sharded over
    ``axis_name``), or from inside your own ``jax.shard_map`` with ``axis_name``. With ``axis_name=None``
    it is ``flash_attention`` of the local sequence. No bias or dense mask (they do not shard along the
    ring): use segment ids for packed sequences.

    Args:
        query: ``[B, T, H, D]``, this device's queries.
        key: ``[B, S, K, D]``, this device's keys.
        value: ``[B, S, K, Dv]``.
        q_segment_ids, kv_segment_ids: ``[B, T]`` and ``[B, S]`` ints; attend only within equal ids.
        softmax_scale: scale of the scores, default ``D ** -0.5``.
        causal: global query p attends global keys ``<= p + n*S - n*T`` (bottom-right aligned).
        sliding_window: ``(left, right)`` keys around the aligned diagonal, or ``w`` for ``(w, w)``.
        logits_soft_cap: ``cap * tanh(scores / cap)`` before masking.
        axis_name: the mesh axis the sequence is sharded over; None: no ring.
        layout: which global positions each device holds: ``"contiguous"`` (slices), ``"zigzag"`` (chunks
            r and 2n-1-r; balanced under ``causal``) or ``"striped"`` (every n-th token). Inputs come laid
            out (``ring_attention_layout``), and the output is in the same layout.
        platform: restrict to one kernel platform (``"xla"``, ...); default: any.
        backend: run for this backend (``"cpu"``, ``"gpu"``, ``"tpu"``); default: JAX's default device.
        cfg: a ``RingAttentionConfig`` that overrides the config chain (never cached); its
            ``q_blocksize``/``kv_blocksize`` tile each device's block of work.
        mesh, in_specs, out_specs: run under ``jax.shard_map``; ``in_specs`` has one spec per array passed.

    Returns:
        ``[B, T, H, Dv]`` in ``query.dtype``, this device's queries' outputs. A row with no admitted key
        gives zeros.

    Raises:
        ValueError, TypeError: a bad shape, dtype or option, an unknown layout, a zigzag shard of odd
            length, or ``axis_name`` not bound where the call runs (the message names it).
        ejkernel.ops.ConfigError: no installed implementation can serve the call (the message says why).

    Example:

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from jax.sharding import PartitionSpec as P
    >>> from ejkernel.modules import ring_attention, ring_attention_layout
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("sp",))  # more devices: a longer ring
    >>> q = jax.random.normal(jax.random.key(0), (2, 64, 8, 32))
    >>> k = v = jax.random.normal(jax.random.key(1), (2, 64, 2, 32))  # GQA: 8 query heads, 2 kv heads
    >>> q, k, v = (ring_attention_layout(x, 1, "zigzag") for x in (q, k, v))
    >>> spec = P(None, "sp")  # the sequence axis sharded over "sp"
    >>> out = ring_attention(q, k, v, causal=True, axis_name="sp", layout="zigzag",
    ...                      mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)
    >>> ring_attention_layout(out, 1, "zigzag", inverse=True).shape
    (2, 64, 8, 32)
    """
    arrays = {
        "query": query,
        "key": key,
        "value": value,
        "q_segment_ids": q_segment_ids,
        "kv_segment_ids": kv_segment_ids,
    }
    options = {
        "softmax_scale": softmax_scale,
        "causal": causal,
        "sliding_window": sliding_window,
        "logits_soft_cap": logits_soft_cap,
        "axis_name": axis_name,
        "layout": layout,
    }
    return dispatch(
        _kernel,
        arrays,
        options,
        platform=platform,
        backend=backend,
        cfg=cfg,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
    )


def ring_attention_layout(
    x: jax.Array, axis_size: int, layout: str, *, inverse: bool = False, axis: int = 1
) -> jax.Array:
    """Permute a whole sequence along ``axis`` into ``layout`` for ``axis_size`` devices (or back, ``inverse``).

    After ``ring_attention_layout(x, n, layout)``, the r-th of n contiguous slices along ``axis`` holds
    the positions device r has under ``layout`` (see ``ejkernel.modules.operations.ring_attention``), so
    plain sequence sharding (``PartitionSpec(None, axis_name)``) hands every device its part;
    ``inverse=True`` restores the natural order of such an array (e.g. ``ring_attention``'s output).
    ``"contiguous"`` is the identity.

    Raises:
        ValueError: an unknown layout, or a length along ``axis`` that is not a multiple of ``axis_size``
            (of ``2 * axis_size`` for ``"zigzag"``).

    >>> import jax.numpy as jnp
    >>> x = jnp.arange(8)[None]
    >>> ring_attention_layout(x, 2, "zigzag")[0].tolist()  # chunks 0, 3 | 1, 2
    [0, 1, 6, 7, 2, 3, 4, 5]
    >>> ring_attention_layout(x, 2, "striped")[0].tolist()
    [0, 2, 4, 6, 1, 3, 5, 7]
    >>> ring_attention_layout(ring_attention_layout(x, 2, "zigzag"), 2, "zigzag", inverse=True)[0].tolist()
    [0, 1, 2, 3, 4, 5, 6, 7]
    """
    perm = layout_permutation(layout, axis_size, x.shape[axis])
    if inverse:
        perm = perm.argsort()
    return jnp.take(x, jnp.asarray(perm, jnp.int32), axis=axis)
