"""The ``ragged_page_attention`` contract: mixed prefill and decode over a paged key/value cache, in one ragged batch.

Shapes: T query rows (packed over the sequences, padding at the end), S sequence slots, H query heads,
K key/value heads (H % K == 0; query head h reads kv head h // (H // K)), D query/key head dim, Dv
value head dim, P pages in the cache, page tokens per page, M pages per sequence at most.

The layout follows ``jax.experimental.pallas.ops.tpu.ragged_paged_attention`` (keys and values in two
caches here): token ``j`` of sequence ``s`` is row ``j % page`` of page ``block_tables[s, j // page]``.

Semantics. ``n = min(num_seqs, S)`` sequences are live. Live sequence ``s`` owns the query rows
``cu_q_lens[s] <= t < cu_q_lens[s + 1]`` (``q_len = cu_q_lens[s + 1] - cu_q_lens[s]``, its new tokens,
already written to the cache) and has ``kv_len = kv_lens[s]`` tokens in the cache, ``q_len <= kv_len``:
its queries are the last ``q_len`` tokens of its context. For row ``r = t - cu_q_lens[s]`` of it:

1. the query sits at position ``i = kv_len - q_len + r`` and may attend the keys ``0 <= j <= i``
   (causal within the sequence); with ``sliding_window=W`` only ``i - W < j`` (its last ``W`` positions);
2. ``s_j = softmax_scale * q . k_j`` (default ``D ** -0.5``); with ``logits_soft_cap``:
   ``s_j = cap * tanh(s_j / cap)``;
3. softmax over the admitted keys in float32, ``out = sum_j p_j v_j`` in the dtype of ``query``.

Rows owned by no live sequence (``t >= cu_q_lens[n]``: padding) give zeros. Entries of ``kv_lens``,
``block_tables`` and ``cu_q_lens`` of sequences ``>= n`` are never read and may hold anything, as may
the entries of ``block_tables[s]`` past the first ``ceil(kv_len / page)``; the entries that are read
must be in ``[0, P)``. Cache contents at positions ``>= kv_len`` never change the output, NaN included.
Must hold: ``num_seqs >= 0``, ``cu_q_lens[0] == 0``, ``cu_q_lens`` non-decreasing up to ``cu_q_lens[n] <= T``,
``q_len <= kv_len <= M * page``. Concrete metadata is checked (``ValueError`` naming the first bad entry);
under ``jit`` it is traced and unchecked unless ``EJKERNEL_CHECKS=1`` (then the call fails when it runs), and a
violation gives a wrong output without an error (the XLA implementation clamps page indices into ``[0, P)``).
``num_seqs`` is an int array of shape ``[1]`` (as in JAX) or ``[]``, or a Python int. ``query``, ``key_cache``
and ``value_cache`` share one float dtype, or the cache is float8 (``float8_e4m3fn`` or ``float8_e5m2``, both
alike): key ``j`` is then ``k_scale * key_cache[..j..]`` in float32 and its value ``v_scale * value_cache[..j..]``,
each scale a positive float (per tensor) or a float array ``[K]`` (per kv head); None is 1, and scales apply to
any cache dtype (as ``page_attention``).

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

from ejkernel.kernels.signatures._checks import (
    ArrayIn,
    check_offsets,
    check_pages,
    check_values,
    describe,
    is_int_array,
    shape,
)
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
from ejkernel.modules.operations.configs import RaggedPageAttentionConfig
from ejkernel.ops import Invocation, Kernel

OP = "ragged_page_attention"


def validate(
    query: Any,
    key_cache: Any,
    value_cache: Any,
    kv_lens: Any,
    block_tables: Any,
    cu_q_lens: Any,
    num_seqs: Any,
    *,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    k_scale: Any = None,
    v_scale: Any = None,
    **_: Any,
) -> None:
    """Check a ``ragged_page_attention`` call; raise an error naming the argument, what was expected and what came."""
    check_paged_cache(OP, query, key_cache, value_cache, "[T, H, D]")
    (s,) = check_int(OP, "kv_lens", kv_lens, (None,), "[S]")
    if check_int(OP, "block_tables", block_tables, (s, None), "[S, M]")[1] == 0:
        raise ValueError(f"{OP}: block_tables needs at least one column (M >= 1), got shape {list(block_tables.shape)}")
    check_int(OP, "cu_q_lens", cu_q_lens, (s + 1,), "[S+1]")
    if isinstance(num_seqs, bool) or not (
        isinstance(num_seqs, int) or (is_int_array(num_seqs) and shape(num_seqs) in ((), (1,)))
    ):
        raise TypeError(
            f"{OP}: num_seqs must be an integer array of shape [1] or [], or an int, got {describe(num_seqs)}"
        )
    check_options(OP, softmax_scale, logits_soft_cap, sliding_window)
    check_cache_scales(OP, shape(key_cache)[2], k_scale=k_scale, v_scale=v_scale)
    t = shape(query)[0]
    num_pages, page = shape(key_cache)[:2]
    check_values(
        lambda *values: _check_metadata(*values, t=t, page=page, num_pages=num_pages),
        kv_lens,
        block_tables,
        cu_q_lens,
        num_seqs,
    )


def _check_metadata(
    kv_lens: np.ndarray,
    block_tables: np.ndarray,
    cu_q_lens: np.ndarray,
    num_seqs: np.ndarray,
    *,
    t: int,
    page: int,
    num_pages: int,
) -> None:
    """The values of the live sequences' metadata (``ValueError``); those of the other slots are never read."""
    live = int(num_seqs.reshape(-1)[0])
    if live < 0:
        raise ValueError(f"{OP}: num_seqs = {live} must be >= 0 (the number of live sequences)")
    n = min(live, kv_lens.shape[0])
    if n == 0:
        return
    cu = cu_q_lens[: n + 1].astype(np.int64)
    if cu[0] != 0:
        raise ValueError(f"{OP}: cu_q_lens[0] = {cu[0]} must be 0 (the first sequence's query rows start at row 0)")
    check_offsets(OP, "cu_q_lens", cu, t)
    kv = kv_lens[:n].astype(np.int64)
    q_lens = np.diff(cu)
    at = np.flatnonzero(kv < q_lens)
    if at.size:
        s = int(at[0])
        raise ValueError(
            f"{OP}: kv_lens[{s}] = {kv[s]} is less than sequence {s}'s query length "
            f"cu_q_lens[{s + 1}] - cu_q_lens[{s}] = {q_lens[s]} (its queries are the last tokens of its context)"
        )
    check_pages(OP, "block_tables", block_tables[:n], "kv_lens", kv, page, num_pages)


class RaggedPageAttention(Kernel[RaggedPageAttentionConfig]):
    op_id = "ragged_page_attention"
    config_type = RaggedPageAttentionConfig

    def normalize(self, arguments: dict[str, Any]) -> dict[str, Any]:
        if isinstance(arguments["num_seqs"], int | np.integer):
            # An array, so that every count shares one compiled function and one cache entry.
            arguments["num_seqs"] = jnp.asarray([arguments["num_seqs"]], jnp.int32)
        return normalize_options(arguments, arguments["query"].shape[-1])

    def make_inputs(self, inv: Invocation, seed: int = 0) -> dict[str, Any]:
        inputs = super().make_inputs(inv, seed)
        t = inv.arguments["query"].shape[0]
        s, m = inv.arguments["block_tables"].shape
        num_pages, page = inv.arguments["key_cache"].shape[:2]
        # Every slot live, the rows shared evenly, every context as long as the table allows: representative work.
        cu = np.floor(np.arange(s + 1) * min(t / s, m * page)).astype(np.int64)  # q_len <= kv_len
        kv = np.full(s, m * page)
        tables = (np.arange(s * m) % num_pages).reshape(s, m)
        for name, value in (("cu_q_lens", cu), ("kv_lens", kv), ("block_tables", tables)):
            inputs[name] = jnp.asarray(value, inv.arguments[name].dtype)
        ns = inv.arguments["num_seqs"]
        inputs["num_seqs"] = jnp.full(ns.shape, s, ns.dtype)
        return inputs

    def empty_result(self, arguments: Mapping[str, Any]) -> Any:
        query, value_cache = arguments["query"], arguments["value_cache"]
        # No rows (T == 0), or no sequence slots (S == 0): every row is padding, which gives zeros.
        no_seqs = arguments["kv_lens"].shape[0] == 0
        return zeros_if_empty((*query.shape[:-1], value_cache.shape[-1]), query.dtype, no_seqs)


_kernel = RaggedPageAttention()


@checked
def ragged_page_attention(
    query: Float[ArrayIn, "T H D"],
    key_cache: Float[ArrayIn, "P page K D"],
    value_cache: Float[ArrayIn, "P page K Dv"],
    kv_lens: Integer[ArrayIn, "S"],
    block_tables: Integer[ArrayIn, "S M"],
    cu_q_lens: Integer[ArrayIn, "S1"],
    num_seqs: Integer[ArrayIn, "1"] | Integer[ArrayIn, ""] | int,
    *,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    k_scale: float | np.floating | Float[ArrayIn, ""] | Float[ArrayIn, "K"] | None = None,
    v_scale: float | np.floating | Float[ArrayIn, ""] | Float[ArrayIn, "K"] | None = None,
    platform: str | None = None,
    backend: str | None = None,
    cfg: RaggedPageAttentionConfig | None = None,
    mesh: jax.sharding.Mesh | None = None,
    in_specs: Any = None,
    out_specs: Any = None,
) -> Float[Array, "T H Dv"]:
    """Mixed prefill and decode attention over a paged key/value cache, all sequences in one ragged batch.

    Shapes: T query rows (every sequence's new tokens, packed; padding at the end), S sequence slots,
    H query heads, K key/value heads (H % K == 0), D head dim, Dv value head dim, P pages, page tokens per
    page, M pages per sequence at most. Sequence ``s``'s ``q_len`` queries are the last tokens of its
    ``kv_lens[s]`` (already in the cache): row ``r`` sits at position ``kv_lens[s] - q_len + r`` and
    attends causally. Layout as ``jax.experimental.pallas.ops.tpu.ragged_paged_attention`` (two caches).

    Args:
        query: ``[T, H, D]``.
        key_cache: ``[P, page, K, D]``.
        value_cache: ``[P, page, K, Dv]``.
        kv_lens: ``[S]`` ints, the context length of every sequence (``>=`` its query count).
        block_tables: ``[S, M]`` ints, the pages of every sequence; entries not needed are never read.
        cu_q_lens: ``[S + 1]`` ints, sequence ``s`` owns query rows ``cu_q_lens[s]:cu_q_lens[s + 1]``.
        num_seqs: how many slots are live (an int array ``[1]`` or ``[]``, or an int); later slots are
            padding, and so are the rows from ``cu_q_lens[num_seqs]`` on (they give zeros).
        softmax_scale: scale of the scores, default ``D ** -0.5``.
        logits_soft_cap: ``cap * tanh(scores / cap)``.
        sliding_window: ``W``: a query at position ``i`` attends only ``i - W < j <= i``.
        k_scale: the keys' dequantization scale: a positive float, or a float array ``[K]`` (per kv head); the
            key is ``k_scale * key_cache`` in float32 (a float8 cache). Default 1.
        v_scale: the values' scale, likewise.
        platform: restrict to one kernel platform (``"xla"``, ``"pallas"``, ...); default: any.
        backend: run for this backend (``"cpu"``, ``"gpu"``, ``"tpu"``); default: JAX's default device.
        cfg: a ``RaggedPageAttentionConfig`` that overrides the config chain (never cached).
        mesh, in_specs, out_specs: run under ``jax.shard_map``; ``in_specs`` has one spec per array passed.

    Returns:
        ``[T, H, Dv]`` in ``query.dtype``.

    Raises:
        ValueError, TypeError: a bad shape, dtype or option (the message names it); ``TypeError`` when
            differentiated (the op is not differentiable; ``jax.lax.stop_gradient`` its inputs).
        ejkernel.ops.ConfigError: no installed implementation can serve the call (the message says why).

    Example:

    >>> import jax, jax.numpy as jnp
    >>> from ejkernel.modules import ragged_page_attention
    >>> q = jax.random.normal(jax.random.key(0), (8, 4, 32))  # 8 rows: a prefill of 5, a decode of 1, 2 padding
    >>> k_cache = v_cache = jax.random.normal(jax.random.key(1), (8, 4, 2, 32))  # 8 pages of 4 tokens
    >>> kv_lens = jnp.array([5, 9, 0])  # the third slot is not live
    >>> tables = jnp.array([[0, 1, -1], [2, 3, 4], [-1, -1, -1]])
    >>> cu_q_lens = jnp.array([0, 5, 6, 6])
    >>> out = ragged_page_attention(q, k_cache, v_cache, kv_lens, tables, cu_q_lens, jnp.array([2]))
    >>> out.shape, bool(jnp.all(out[6:] == 0))
    ((8, 4, 32), True)
    """
    query, key_cache, value_cache = refuse_gradients("ragged_page_attention", query, key_cache, value_cache)
    arrays: dict[str, Any] = {
        "query": query,
        "key_cache": key_cache,
        "value_cache": value_cache,
        "kv_lens": kv_lens,
        "block_tables": block_tables,
        "cu_q_lens": cu_q_lens,
        "num_seqs": num_seqs,
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
