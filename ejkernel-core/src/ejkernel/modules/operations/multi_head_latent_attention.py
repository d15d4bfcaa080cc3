"""``multi_head_latent_attention`` (alias ``flash_mla``): the public function and its operations-layer ``Kernel``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jaxtyping import Array, Float, Int

from ejkernel.kernels.signatures.multi_head_latent_attention import resolve_latent_dim
from ejkernel.modules.operations._dispatch import dispatch
from ejkernel.modules.operations._empty import zeros_if_empty
from ejkernel.modules.operations.configs import MultiHeadLatentAttentionConfig
from ejkernel.ops import Invocation, Kernel


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


def multi_head_latent_attention(
    query: Float[Array, "B T H D"],
    kv: Float[Array, "B S D"] | Float[Array, "P page D"],
    *,
    latent_dim: int | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    block_tables: Int[Array, "B maxp"] | None = None,
    cache_seqlens: Int[Array, "B"] | None = None,
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
