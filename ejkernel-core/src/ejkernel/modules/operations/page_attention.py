"""The ``page_attention`` contract: one decode query per sequence over a paged key/value cache.

Shapes: N sequences, H query heads, K key/value heads (H % K == 0; query head h reads kv head
h // (H // K)), D query/key head dim, Dv value head dim, P pages in the cache, page tokens per page,
M pages per sequence at most (the columns of ``block_tables``).

Cache layout: token ``j`` of sequence ``n`` is row ``j % page`` of page ``block_tables[n, j // page]``,
so its key is ``key_cache[block_tables[n, j // page], j % page]`` (``[K, D]``), its value likewise.

Semantics, for sequence ``n`` with ``L = context_lens[n]`` (``0 <= L <= M * page``):

1. the query sits at position ``L - 1`` and may attend the keys ``0 <= j < L``; with
   ``sliding_window=W`` only ``L - W <= j`` (its last ``W`` positions, its own included);
2. ``s_j = softmax_scale * q . k_j`` (``softmax_scale`` defaults to ``D ** -0.5``); with
   ``logits_soft_cap``: ``s_j = cap * tanh(s_j / cap)``;
3. softmax over the admitted keys in float32, ``out = sum_j p_j v_j`` in the dtype of ``query``;
4. ``L == 0`` gives zeros (never NaN).

Entries of ``block_tables[n]`` past the first ``ceil(L / page)`` are never read and may hold anything
(``-1``, a stale page, out of range); the entries that are read must be in ``[0, P)``. Cache contents at
positions ``>= L`` (the rest of the last page) never change the output, whatever they hold, NaN included.
``query``, ``key_cache`` and ``value_cache`` share one float dtype, or the cache is float8 (``float8_e4m3fn`` or
``float8_e5m2``, both alike: a quantized cache, as serving engines keep it): key ``j`` is then
``k_scale * key_cache[..j..]`` in float32 and its value ``v_scale * value_cache[..j..]``, each scale a positive float
(per tensor) or a float array ``[K]`` (per kv head); None is 1, and scales apply to any cache dtype.

Concrete ``context_lens`` and ``block_tables`` are checked: a length outside ``[0, M * page]`` or a read entry
outside ``[0, P)`` raises ``ValueError``. Under ``jit`` they are traced and unchecked unless ``EJKERNEL_CHECKS=1``
(then the call fails when it runs); such an entry gives a wrong output without an error (the XLA implementation
clamps it: ``>= P`` reads page ``P - 1``, a negative one page 0), as does a length past ``M * page``.

Not differentiable: differentiating a call raises ``TypeError`` (inputs under ``jax.lax.stop_gradient`` pass).

The op is defined here once: this contract, ``validate``, the ``Kernel`` and the public function, whose
parameters are the canonical signature (``ejkernel.kernels.signatures.canonical_signature``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Integer

from ejkernel.kernels.signatures._checks import ArrayIn, check_pages, check_values, shape
from ejkernel.kernels.signatures._serving import (
    check_cache_scales,
    check_int,
    check_options,
    check_paged_cache,
    normalize_options,
    refuse_gradients,
)
from ejkernel.modules.operations._dispatch import dispatch
from ejkernel.modules.operations._empty import zeros_if_empty
from ejkernel.modules.operations._typecheck import checked
from ejkernel.modules.operations.configs import PageAttentionConfig
from ejkernel.ops import Invocation, Kernel

OP = "page_attention"


def validate(
    query: Any,
    key_cache: Any,
    value_cache: Any,
    context_lens: Any,
    block_tables: Any,
    *,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    k_scale: Any = None,
    v_scale: Any = None,
    **_: Any,
) -> None:
    """Check a ``page_attention`` call; raise an error naming the argument, what was expected and what came."""
    n = check_paged_cache(OP, query, key_cache, value_cache, "[N, H, D]")[0]
    check_int(OP, "context_lens", context_lens, (n,), "[N]")
    if check_int(OP, "block_tables", block_tables, (n, None), "[N, M]")[1] == 0:
        raise ValueError(f"{OP}: block_tables needs at least one column (M >= 1), got shape {list(block_tables.shape)}")
    check_options(OP, softmax_scale, logits_soft_cap, sliding_window)
    check_cache_scales(OP, shape(key_cache)[2], k_scale=k_scale, v_scale=v_scale)
    num_pages, page = shape(key_cache)[:2]
    check_values(
        lambda lens, tables: check_pages(OP, "block_tables", tables, "context_lens", lens, page, num_pages),
        context_lens,
        block_tables,
    )


class PageAttention(Kernel[PageAttentionConfig]):
    op_id = "page_attention"
    config_type = PageAttentionConfig

    def normalize(self, arguments: dict[str, Any]) -> dict[str, Any]:
        return normalize_options(arguments, arguments["query"].shape[-1])

    def make_inputs(self, inv: Invocation, seed: int = 0) -> dict[str, Any]:
        inputs = super().make_inputs(inv, seed)
        n, m = inv.arguments["block_tables"].shape
        num_pages, page = inv.arguments["key_cache"].shape[:2]
        # Distinct pages while the cache has enough; lengths from half to all of the table: representative work.
        tables = (np.arange(n * m) % num_pages).reshape(n, m)
        lens = np.linspace(m * page // 2, m * page, n).astype(np.int64)
        inputs["block_tables"] = jnp.asarray(tables, inv.arguments["block_tables"].dtype)
        inputs["context_lens"] = jnp.asarray(lens, inv.arguments["context_lens"].dtype)
        return inputs

    def empty_result(self, arguments: Mapping[str, Any]) -> Any:
        query, value_cache = arguments["query"], arguments["value_cache"]
        return zeros_if_empty((*query.shape[:-1], value_cache.shape[-1]), query.dtype)  # no sequences (N == 0)


_kernel = PageAttention()


@checked
def page_attention(
    query: Float[ArrayIn, "N H D"],
    key_cache: Float[ArrayIn, "P page K D"],
    value_cache: Float[ArrayIn, "P page K Dv"],
    context_lens: Integer[ArrayIn, "N"],
    block_tables: Integer[ArrayIn, "N M"],
    *,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    k_scale: float | np.floating | Float[ArrayIn, ""] | Float[ArrayIn, "K"] | None = None,
    v_scale: float | np.floating | Float[ArrayIn, ""] | Float[ArrayIn, "K"] | None = None,
    platform: str | None = None,
    backend: str | None = None,
    cfg: PageAttentionConfig | None = None,
    mesh: jax.sharding.Mesh | None = None,
    in_specs: Any = None,
    out_specs: Any = None,
) -> Float[Array, "N H Dv"]:
    """Decode attention over a paged key/value cache: one query per sequence, at the end of its context.

    Shapes: N sequences, H query heads, K key/value heads (H % K == 0: GQA, MQA when K == 1), D head
    dim, Dv value head dim, P pages, page tokens per page, M pages per sequence at most. Token ``j`` of
    sequence ``n`` is row ``j % page`` of page ``block_tables[n, j // page]``.

    Args:
        query: ``[N, H, D]``, the newest token of every sequence.
        key_cache: ``[P, page, K, D]``.
        value_cache: ``[P, page, K, Dv]``.
        context_lens: ``[N]`` ints, ``L`` keys per sequence (its query sits at position ``L - 1``); 0 gives zeros.
        block_tables: ``[N, M]`` ints, the pages of every sequence in order; entries past ``ceil(L / page)``
            are never read (any value, e.g. -1); those read must be in ``[0, P)``.
        softmax_scale: scale of the scores, default ``D ** -0.5``.
        logits_soft_cap: ``cap * tanh(scores / cap)``.
        sliding_window: ``W``: attend only the last ``W`` positions (``L - W <= j < L``).
        k_scale: the keys' dequantization scale: a positive float, or a float array ``[K]`` (per kv head); the
            key is ``k_scale * key_cache`` in float32 (a float8 cache). Default 1.
        v_scale: the values' scale, likewise.
        platform: restrict to one kernel platform (``"xla"``, ``"pallas"``, ...); default: any.
        backend: run for this backend (``"cpu"``, ``"gpu"``, ``"tpu"``); default: JAX's default device.
        cfg: a ``PageAttentionConfig`` that overrides the config chain (never cached).
        mesh, in_specs, out_specs: run under ``jax.shard_map``; ``in_specs`` has one spec per array passed.

    Returns:
        ``[N, H, Dv]`` in ``query.dtype``.

    Raises:
        ValueError, TypeError: a bad shape, dtype or option (the message names it); ``TypeError`` when
            differentiated (the op is not differentiable; ``jax.lax.stop_gradient`` its inputs).
        ejkernel.ops.ConfigError: no installed implementation can serve the call (the message says why).

    Example:

    >>> import jax, jax.numpy as jnp
    >>> from ejkernel.modules import page_attention
    >>> q = jax.random.normal(jax.random.key(0), (3, 8, 64))  # 3 sequences, 8 query heads
    >>> k_cache = v_cache = jax.random.normal(jax.random.key(1), (16, 4, 2, 64))  # 16 pages of 4 tokens, 2 kv heads
    >>> tables = jnp.array([[3, 7, 0], [1, 2, -1], [5, -1, -1]])  # -1: unused
    >>> out = page_attention(q, k_cache, v_cache, jnp.array([10, 6, 0]), tables)
    >>> out.shape, bool(jnp.all(out[2] == 0))  # the empty sequence gives zeros
    ((3, 8, 64), True)
    """
    query, key_cache, value_cache = refuse_gradients("page_attention", query, key_cache, value_cache)
    arrays: dict[str, Any] = {
        "query": query,
        "key_cache": key_cache,
        "value_cache": value_cache,
        "context_lens": context_lens,
        "block_tables": block_tables,
    }
    options: dict[str, Any] = {
        "softmax_scale": softmax_scale,
        "logits_soft_cap": logits_soft_cap,
        "sliding_window": sliding_window,
    }
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):  # an array scale is traced, a float static
        (arrays if hasattr(x, "dtype") else options)[name] = x
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
