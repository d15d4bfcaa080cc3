"""The ``multi_head_latent_attention`` contract (DeepSeek MLA in absorbed form; alias ``flash_mla``).

Shapes: B batch, T query length, S key length, H query heads, Dl latent dim (the value dim),
Dr rotary dim, D = Dl + Dr the query/key dim; paged: P cache pages, page tokens per page,
maxp pages per sequence.

Every head attends one shared latent per key: all ``D`` dims of ``kv`` are the key of every head,
its first ``Dl`` dims ``kv[..., :Dl]`` the value (MQA whose value is a prefix of the key).

Dense (``block_tables`` and ``cache_seqlens`` absent): ``kv`` is ``[B, S, D]``, every batch has
``S`` keys. Paged (both given): ``kv`` is a cache ``[P, page, D]``; batch ``b`` has
``L_b = cache_seqlens[b]`` keys, key ``j`` is stored at ``kv[block_tables[b, j // page], j % page]``.
Entries of ``block_tables[b]`` past the first ``ceil(L_b / page)`` are never read (they may hold
anything); the ones read must lie in ``[0, P)``, and ``0 <= L_b <= maxp * page``. Concrete ``block_tables``
and ``cache_seqlens`` are checked (``ValueError``); under ``jit`` they are traced and unchecked unless
``EJKERNEL_CHECKS=1`` (then the call fails when it runs), and a bad entry gives a wrong output without an
error (the XLA implementation clamps page indices into ``[0, P)`` and lengths into ``[0, maxp * page]``).

For query ``i`` and key ``j`` of batch ``b`` (``L = S`` when dense, ``L_b`` when paged):

1. ``s = softmax_scale * q_i . kv_j`` over all ``D`` dims (``softmax_scale`` defaults to
   ``D ** -0.5``; DeepSeek models pass ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``);
2. the key is admitted if ``j < L`` and, with ``causal``, ``j <= i + L - T`` (bottom-right
   aligned as in FlashAttention 2: the queries are the last ``T`` positions of the sequence);
3. softmax over the admitted keys in float32; a row with no admitted key (``L_b == 0``, or a
   causal row before the first key) gives zeros, never NaN;
4. ``out = P @ kv[..., :Dl]``, ``[B, T, H, Dl]`` in the dtype of ``query``.

``latent_dim`` (Dl) must be given unless ``D == 576``, which means DeepSeek-V2/V3's 512 latent
dims plus 64 rotary dims (``latent_dim=512``). Both variants are differentiable in ``query`` and
``kv`` (the latent gets gradient through both its key and its value role; a paged cache gets it
at the slots that were read, zeros elsewhere).

The op is defined here once: this contract, ``validate``, the ``Kernel`` and the public function, whose
parameters are the canonical signature (``ejkernel.kernels.signatures.canonical_signature``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jaxtyping import Array, Float, Integer

from ejkernel.kernels.signatures._checks import (
    ArrayIn,
    check_bool,
    check_float,
    check_float_array,
    check_pages,
    check_same_dtype,
    check_scale,
    check_values,
    describe,
    is_int_array,
    shape,
)
from ejkernel.modules.operations._dispatch import dispatch
from ejkernel.modules.operations._empty import zeros_if_empty
from ejkernel.modules.operations._typecheck import checked
from ejkernel.modules.operations.configs import MultiHeadLatentAttentionConfig
from ejkernel.ops import Invocation, Kernel

OP = "multi_head_latent_attention"
# DeepSeek-V2/V3: kv_lora_rank 512 + qk_rope_head_dim 64; the one last dim whose latent dim is implied.
DEEPSEEK_DIM, DEEPSEEK_LATENT_DIM = 576, 512


def resolve_latent_dim(latent_dim: int | None, dim: int) -> int:
    """``latent_dim`` as given, or 512 when it is None and the last dim is 576 (DeepSeek-V2/V3).

    Raises:
        ValueError: None with another last dim, or not in ``[1, dim]``.
    """
    if latent_dim is None:
        if dim != DEEPSEEK_DIM:
            raise ValueError(
                f"multi_head_latent_attention: latent_dim is required unless the last dim of query/kv is "
                f"{DEEPSEEK_DIM} (DeepSeek's {DEEPSEEK_LATENT_DIM} latent + 64 rotary dims), got last dim {dim}"
            )
        return DEEPSEEK_LATENT_DIM
    if isinstance(latent_dim, bool) or not isinstance(latent_dim, int | np.integer):
        raise TypeError(f"multi_head_latent_attention: latent_dim must be an int or None, got {latent_dim!r}")
    if not 1 <= latent_dim <= dim:
        raise ValueError(
            f"multi_head_latent_attention: latent_dim must be in [1, {dim}] (the last dim of query/kv), got {latent_dim}"
        )
    return int(latent_dim)


def validate(
    query: Any,
    kv: Any,
    *,
    latent_dim: int | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    block_tables: Any = None,
    cache_seqlens: Any = None,
    **_: Any,
) -> None:
    """Check a ``multi_head_latent_attention`` call; raise an error naming the argument, what was expected and what came."""
    paged = block_tables is not None or cache_seqlens is not None
    q = check_float_array(OP, "query", query, "[B, T, H, D]")
    b, d = q[0], q[3]
    if len(shape(kv)) != 3:
        layout = "a paged cache [P, page, D]" if paged else "[B, S, D] (one latent shared by all heads)"
        raise ValueError(f"{OP}: kv must be 3-D {layout}, got {describe(kv)}")
    check_float(OP, "kv", kv)
    check_same_dtype(OP, {"query": query, "kv": kv})
    if shape(kv)[2] != d:
        raise ValueError(f"{OP}: kv's last dim must equal query's last dim D={d}, got kv shape {list(shape(kv))}")
    resolve_latent_dim(latent_dim, d)
    if paged:
        if block_tables is None or cache_seqlens is None:
            raise ValueError(
                f"{OP}: the paged variant needs both block_tables and cache_seqlens, got only "
                + ("block_tables" if block_tables is not None else "cache_seqlens")
            )
        if len(shape(block_tables)) != 2 or shape(block_tables)[0] != b or not is_int_array(block_tables):
            raise ValueError(
                f"{OP}: block_tables must be an integer array [B, maxp] with B={b}, got {describe(block_tables)}"
            )
        if shape(cache_seqlens) != (b,) or not is_int_array(cache_seqlens):
            raise ValueError(
                f"{OP}: cache_seqlens must be an integer array [B] with B={b}, got {describe(cache_seqlens)}"
            )
        num_pages, page = shape(kv)[:2]
        check_values(
            lambda lens, tables: check_pages(OP, "block_tables", tables, "cache_seqlens", lens, page, num_pages),
            cache_seqlens,
            block_tables,
        )
    elif shape(kv)[0] != b:
        raise ValueError(f"{OP}: kv must be [B, S, D] with the batch B={b} of query, got {list(shape(kv))}")
    check_scale(OP, "softmax_scale", softmax_scale)
    check_bool(OP, "causal", causal)


class MultiHeadLatentAttention(Kernel[MultiHeadLatentAttentionConfig]):
    op_id = "multi_head_latent_attention"
    config_type = MultiHeadLatentAttentionConfig

    def normalize(self, arguments: dict[str, Any]) -> dict[str, Any]:
        d = arguments["query"].shape[-1]
        arguments["latent_dim"] = resolve_latent_dim(arguments["latent_dim"], d)
        arguments["softmax_scale"] = float(
            d**-0.5 if arguments["softmax_scale"] is None else arguments["softmax_scale"]
        )
        return arguments

    def make_inputs(self, inv: Invocation, seed: int = 0) -> dict[str, Any]:
        inputs = super().make_inputs(inv, seed)
        tables = inv.arguments.get("block_tables")
        if isinstance(tables, jax.ShapeDtypeStruct):
            # Every sequence full, its pages spread over the cache: representative work for timing.
            b, maxp = tables.shape
            num_pages, page = inv.arguments["kv"].shape[:2]
            pages = np.random.default_rng(seed).permutation(max(num_pages, b * maxp)) % num_pages
            inputs["block_tables"] = jax.numpy.asarray(pages[: b * maxp].reshape(b, maxp), tables.dtype)
            lens = inv.arguments["cache_seqlens"]
            inputs["cache_seqlens"] = jax.numpy.full(lens.shape, maxp * page, lens.dtype)
        return inputs

    def empty_result(self, arguments: Mapping[str, Any]) -> Any:
        query, kv, tables = arguments["query"], arguments["kv"], arguments["block_tables"]
        # No keys: a dense kv of S == 0, or a paged cache that can hold none (no page, no token, no table column).
        no_keys = kv.shape[1] == 0 if tables is None else 0 in (*kv.shape[:2], tables.shape[1])
        return zeros_if_empty((*query.shape[:-1], arguments["latent_dim"]), query.dtype, no_keys)


_kernel = MultiHeadLatentAttention()


@checked
def multi_head_latent_attention(
    query: Float[ArrayIn, "B T H D"],
    kv: Float[ArrayIn, "B S D"] | Float[ArrayIn, "P page D"],
    *,
    latent_dim: int | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    block_tables: Integer[ArrayIn, "B maxp"] | None = None,
    cache_seqlens: Integer[ArrayIn, "B"] | None = None,
    platform: str | None = None,
    backend: str | None = None,
    cfg: MultiHeadLatentAttentionConfig | None = None,
    mesh: jax.sharding.Mesh | None = None,
    in_specs: Any = None,
    out_specs: Any = None,
) -> Float[Array, "B T H Dl"]:
    """DeepSeek multi-head latent attention in absorbed form: every head attends one shared latent per key.

    Also exported as ``flash_mla``. The key of all heads is ``kv`` (``D = Dl + Dr`` dims), the value
    its first ``Dl`` dims; ``kv`` is never repeated over the heads. Dense when ``block_tables`` and
    ``cache_seqlens`` are absent, paged (a decode KV cache) when both are given.

    Shapes: B batch, T query length, S key length, H query heads, Dl latent (value) dim, Dr rotary
    dim, D = Dl + Dr; paged: P cache pages of ``page`` tokens, maxp pages per sequence.

    Args:
        query: ``[B, T, H, D]``, the absorbed queries (latent part, then rotary part).
        kv: dense ``[B, S, D]``; paged ``[P, page, D]``, the cache of latents (rotary part last).
        latent_dim: Dl; required unless ``D == 576`` (DeepSeek-V2/V3: then 512).
        softmax_scale: scale of the scores, default ``D ** -0.5`` (DeepSeek models pass
            ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``).
        causal: query i attends keys ``j <= i + L - T`` with ``L`` the batch's key count (bottom-right
            aligned, as ``flash_attention``).
        block_tables: ``[B, maxp]`` ints, page ``p`` of batch ``b`` is ``kv[block_tables[b, p]]``
            (entries past the pages in use are not read).
        cache_seqlens: ``[B]`` ints, the number of keys of each batch (``0 <= L_b <= maxp * page``).
        platform: restrict to one kernel platform (``"xla"``, ``"pallas"``, ...); default: any.
        backend: run for this backend (``"cpu"``, ``"gpu"``, ``"tpu"``); default: JAX's default device.
        cfg: a ``MultiHeadLatentAttentionConfig`` that overrides the config chain (never cached).
        mesh, in_specs, out_specs: run under ``jax.shard_map``; ``in_specs`` has one spec per array passed.

    Returns:
        ``[B, T, H, Dl]`` in ``query.dtype``. A query row with no admitted key (an empty cache) gives
        zeros. Differentiable in ``query`` and ``kv`` (dense and paged).

    Raises:
        ValueError, TypeError: a bad shape, dtype or option (the message names it).
        ejkernel.ops.ConfigError: no installed implementation can serve the call (the message says why).

    Example:

    >>> import jax, jax.numpy as jnp
    >>> from ejkernel.modules import flash_mla, multi_head_latent_attention
    >>> q = jax.random.normal(jax.random.key(0), (2, 16, 8, 576))  # 8 heads, 512 latent + 64 rotary dims
    >>> kv = jax.random.normal(jax.random.key(1), (2, 64, 576))  # one latent per key, shared by the heads
    >>> multi_head_latent_attention(q, kv, causal=True).shape
    (2, 16, 8, 512)
    >>> cache = kv.reshape(8, 16, 576)  # the same keys as 8 pages of 16 tokens
    >>> tables = jnp.arange(8).reshape(2, 4)
    >>> out = flash_mla(q[:, -1:], cache, block_tables=tables, cache_seqlens=jnp.array([64, 40]))
    >>> out.shape
    (2, 1, 8, 512)
    """
    arrays = {"query": query, "kv": kv, "block_tables": block_tables, "cache_seqlens": cache_seqlens}
    options = {"latent_dim": latent_dim, "softmax_scale": softmax_scale, "causal": causal}
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


flash_mla = multi_head_latent_attention
