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
``query``, ``key_cache`` and ``value_cache`` share one float dtype.

Concrete ``context_lens`` and ``block_tables`` are checked: a length outside ``[0, M * page]`` or a read entry
outside ``[0, P)`` raises ``ValueError``. Under ``jit`` they are traced and unchecked unless ``EJKERNEL_CHECKS=1``
(then the call fails when it runs); such an entry gives a wrong output without an error (the XLA implementation
clamps it: ``>= P`` reads page ``P - 1``, a negative one page 0), as does a length past ``M * page``.

Not differentiable: differentiating a call raises ``TypeError`` (inputs under ``jax.lax.stop_gradient`` pass).
"""

from __future__ import annotations

from typing import Any

from jaxtyping import Array, Float, Int

from ejkernel.kernels.params import BwdParams, FwdParams
from ejkernel.kernels.signatures._checks import check_pages, check_values, shape
from ejkernel.kernels.signatures._serving import check_int, check_options, check_paged_cache
from ejkernel.kernels.signatures._serving import refuse_gradients as refuse_gradients  # for implementations

OP = "page_attention"


def page_attention(
    query: Float[Array, "N H D"],
    key_cache: Float[Array, "P page K D"],
    value_cache: Float[Array, "P page K Dv"],
    context_lens: Int[Array, "N"],
    block_tables: Int[Array, "N M"],
    *,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: int | None = None,
    fwd_params: FwdParams | None = None,
    bwd_params: BwdParams | None = None,
) -> Float[Array, "N H Dv"]:
    """Canonical signature of ``page_attention`` (see the module docstring for the semantics)."""
    raise NotImplementedError


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
    **_: Any,
) -> None:
    """Check a ``page_attention`` call; raise an error naming the argument, what was expected and what came."""
    n = check_paged_cache(OP, query, key_cache, value_cache, "[N, H, D]")[0]
    check_int(OP, "context_lens", context_lens, (n,), "[N]")
    if check_int(OP, "block_tables", block_tables, (n, None), "[N, M]")[1] == 0:
        raise ValueError(f"{OP}: block_tables needs at least one column (M >= 1), got shape {list(block_tables.shape)}")
    check_options(OP, softmax_scale, logits_soft_cap, sliding_window)
    num_pages, page = shape(key_cache)[:2]
    check_values(
        lambda lens, tables: check_pages(OP, "block_tables", tables, "context_lens", lens, page, num_pages),
        context_lens,
        block_tables,
    )
