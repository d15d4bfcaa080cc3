"""Inputs of the serving suites: paged caches with shuffled pages, garbage in unused table slots, poison where unread."""

from __future__ import annotations

import dataclasses

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
