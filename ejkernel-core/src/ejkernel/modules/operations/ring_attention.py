"""``ring_attention``: the public function, its operations-layer ``Kernel`` and the layout helper."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ejkernel.kernels.registry import Implementation
from ejkernel.kernels.signatures.flash_attention import normalize_window
from ejkernel.kernels.signatures.ring_attention import layout_permutation
from ejkernel.modules.operations._dispatch import dispatch
from ejkernel.modules.operations._empty import attention_zeros
from ejkernel.modules.operations.configs import RingAttentionConfig
from ejkernel.ops import Invocation, Kernel


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


def ring_attention(
    query: Float[Array, "B T H D"],
    key: Float[Array, "B S K D"],
    value: Float[Array, "B S K Dv"],
    *,
    q_segment_ids: Int[Array, "B T"] | None = None,
    kv_segment_ids: Int[Array, "B S"] | None = None,
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
    on the whole sequence (see ``ejkernel.kernels.signatures.ring_attention`` for the exact semantics).

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
    the positions device r has under ``layout`` (see ``ejkernel.kernels.signatures.ring_attention``), so
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
