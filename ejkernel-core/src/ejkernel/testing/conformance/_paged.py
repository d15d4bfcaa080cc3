"""Inputs of the serving suites: paged caches with shuffled pages, garbage in unused table slots, poison where unread."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def numpy_rng(key: jax.Array) -> np.random.Generator:
    """A NumPy generator drawn from ``key`` (so that the suite's seed reproduces it). Inputs are drawn with
    NumPy: eager JAX ops would compile once per shape, which costs more than the tests themselves."""
    return np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel().tolist())


def normal(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype)


@dataclasses.dataclass
class PagedCache:
    """``key_cache``/``value_cache`` ``[P, page, K, D|Dv]``, ``block_tables [N, M]`` and which ``(page, row)`` is read."""

    key_cache: jax.Array
    value_cache: jax.Array
    block_tables: jax.Array
    read: np.ndarray  # [P, page] bool: some sequence's token lives there

    def poisoned(self) -> tuple[jax.Array, jax.Array]:
        """The caches with NaN wherever no sequence's token lives (the contract says it never leaks)."""
        unread = ~self.read[:, :, None, None]
        return (
            jnp.asarray(np.where(unread, np.nan, np.asarray(self.key_cache, np.float32)), self.key_cache.dtype),
            jnp.asarray(np.where(unread, np.nan, np.asarray(self.value_cache, np.float32)), self.value_cache.dtype),
        )


def paged_cache(
    rng: np.random.Generator,
    dtype: str,
    lens: list[int],
    *,
    page: int,
    kv_heads: int,
    head_dim: int,
    value_dim: int,
    spare_pages: int = 3,
) -> PagedCache:
    """Random caches holding sequences of ``lens`` tokens on shuffled pages.

    ``M = ceil(max(lens) / page) + 1`` columns (one always unused); the pages of all sequences are a
    random permutation of ``P = sum(pages) + spare_pages`` pages; unused table slots hold ``-1``, an index
    past the cache or some page of another sequence, at random.
    """
    used = [-(-n // page) for n in lens]
    m = max(used + [0]) + 1
    num_pages = sum(used) + spare_pages
    order = rng.permutation(num_pages)
    tables = np.empty((len(lens), m), np.int64)
    read = np.zeros((num_pages, page), bool)
    at = 0
    for n, (length, u) in enumerate(zip(lens, used)):
        tables[n, :u] = order[at : at + u]
        for j in range(length):
            read[tables[n, j // page], j % page] = True
        at += u
        garbage = rng.choice(np.array([-1, num_pages + 7, int(order[0])]), size=m - u)
        tables[n, u:] = garbage
    key_cache = normal(rng, (num_pages, page, kv_heads, head_dim), dtype)
    value_cache = normal(rng, (num_pages, page, kv_heads, value_dim), dtype)
    return PagedCache(key_cache, value_cache, jnp.asarray(tables, jnp.int32), read)


# Float8 caches and their scales, shared by the three serving suites: (query dtype, cache dtype, k_scale, v_scale),
# a scale a float (per tensor) or a tuple (per kv head, passed as an array); the reference dequantizes the same
# float8 values in float32.
FP8_CASES = (
    ("bfloat16", "float8_e4m3fn", 0.5, 2.0, "bf16-e4m3-per_tensor"),
    ("float32", "float8_e5m2", (0.5, 1.5), (2.0, 0.25), "f32-e5m2-per_head"),
    ("bfloat16", "bfloat16", (0.5, 1.5), np.float32(3.0), "bf16-scales_only"),  # a NumPy scalar scale too
)


def quantized(args: tuple[Any, ...], kwargs: dict[str, Any], cache_dtype: str, k_scale: Any, v_scale: Any) -> Any:
    """``args`` (query, key cache, value cache, ...) with the caches cast to ``cache_dtype``, ``kwargs`` with the
    scales (tuples as float32 arrays)."""
    scale = lambda s: jnp.asarray(s, jnp.float32) if isinstance(s, tuple) else s  # noqa: E731
    cast = (args[0], args[1].astype(cache_dtype), args[2].astype(cache_dtype), *args[3:])
    return cast, {**kwargs, "k_scale": scale(k_scale), "v_scale": scale(v_scale)}
