"""Integer metadata checked by value (issue 11): page tables, lengths and sequence offsets that would give a wrong
answer without an error are refused when concrete, and under ``jit`` only with ``EJKERNEL_CHECKS=1``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.kernels.signatures._checks import concrete
from ejkernel.modules import (
    flash_attention,
    gated_delta_rule,
    gla,
    lightning_attn,
    mean_pooling,
    multi_head_latent_attention,
    page_attention,
    ragged_page_attention,
    recurrent,
)

i32 = jnp.int32
# Paged caches: P = 4 pages of 4 tokens, M = 2 table columns (capacity 8 tokens per sequence).
KV_CACHE = jnp.ones((4, 4, 1, 8))
MLA_CACHE = jnp.ones((4, 4, 8))


def _page(lens: list[int], tables: list[list[int]]) -> tuple[Callable[..., Any], dict[str, Any], dict[str, Any]]:
    arrays = dict(
        query=jnp.ones((2, 2, 8)),
        key_cache=KV_CACHE,
        value_cache=KV_CACHE,
        context_lens=jnp.array(lens, i32),
        block_tables=jnp.array(tables, i32),
    )
    return page_attention, arrays, {}


def _ragged(
    kv_lens: list[int], tables: list[list[int]], cu: list[int], num_seqs: int = 2
) -> tuple[Callable[..., Any], dict[str, Any], dict[str, Any]]:
    arrays = dict(
        query=jnp.ones((6, 2, 8)),
        key_cache=KV_CACHE,
        value_cache=KV_CACHE,
        kv_lens=jnp.array(kv_lens, i32),
        block_tables=jnp.array(tables, i32),
        cu_q_lens=jnp.array(cu, i32),
        num_seqs=jnp.array([num_seqs], i32),
    )
    return ragged_page_attention, arrays, {}


def _mla(lens: list[int], tables: list[list[int]]) -> tuple[Callable[..., Any], dict[str, Any], dict[str, Any]]:
    arrays = dict(
        query=jnp.ones((2, 1, 2, 8)),
        kv=MLA_CACHE,
        block_tables=jnp.array(tables, i32),
        cache_seqlens=jnp.array(lens, i32),
    )
    return multi_head_latent_attention, arrays, {"latent_dim": 4}


def _pool(cu: list[int]) -> tuple[Callable[..., Any], dict[str, Any], dict[str, Any]]:
    return mean_pooling, dict(x=jnp.ones((1, 10, 4)), cu_seqlens=jnp.array(cu, i32)), {}


def _linear(fn: Callable[..., Any], cu: list[int]) -> tuple[Callable[..., Any], dict[str, Any], dict[str, Any]]:
    q = jnp.ones((1, 8, 1, 4))
    arrays: dict[str, Any] = dict(q=q, k=q, v=q, cu_seqlens=jnp.array(cu, i32))
    if fn is gla:
        arrays["g"] = -jnp.ones((1, 8, 1, 4))
    elif fn is gated_delta_rule:
        arrays["g"] = arrays["beta"] = -jnp.ones((1, 8, 1)) * 0.5
    elif fn is lightning_attn:
        arrays["slope"] = jnp.ones((1,))
    return fn, arrays, {}


def _flash(cu_q: list[int], cu_k: list[int]) -> tuple[Callable[..., Any], dict[str, Any], dict[str, Any]]:
    q = jnp.ones((1, 8, 1, 4))
    arrays = dict(query=q, key=q, value=q, cu_seqlens_q=jnp.array(cu_q, i32), cu_seqlens_k=jnp.array(cu_k, i32))
    return flash_attention, arrays, {"causal": True}


# Valid baselines: page_attention/MLA lens (3, 6) on tables [[0, -1], [1, 2]] (row 0's -1 is padding: unread);
# ragged_page_attention has 2 live sequences (q_len, kv_len) = (2, 3), (1, 5); slot 2 is garbage, never read.
RAGGED_TABLES = [[0, -1], [1, 2], [9, -5]]
BAD = [
    ("page_table_past_P", _page([3, 6], [[0, -1], [1, 9]]), r"page_attention: block_tables\[1, 1\] = 9 is not a page"),
    ("page_table_negative", _page([3, 6], [[-1, 0], [1, 2]]), r"page_attention: block_tables\[0, 0\] = -1 is not a"),
    ("page_lens_past_capacity", _page([3, 9], [[0, -1], [1, 2]]), r"context_lens\[1\] = 9 is outside \[0, M \* page\]"),
    ("page_lens_negative", _page([-1, 6], [[0, -1], [1, 2]]), r"page_attention: context_lens\[0\] = -1 is outside"),
    (
        "ragged_table_past_P",
        _ragged([3, 5, 1000], [[0, -1], [1, 4], [9, -5]], [0, 2, 3, 99]),
        r"ragged_page_attention: block_tables\[1, 1\] = 4 is not a page of the cache: .* \[0, P\) = \[0, 4\)",
    ),
    (
        "ragged_kv_past_capacity",
        _ragged([3, 9, 0], RAGGED_TABLES, [0, 2, 3, 3]),
        r"ragged_page_attention: kv_lens\[1\] = 9 is outside \[0, M \* page\] = \[0, 8\]",
    ),
    (
        "ragged_cu_decreasing",
        _ragged([3, 5, 0], RAGGED_TABLES, [0, 3, 2, 2]),
        r"cu_q_lens must be non-decreasing, got cu_q_lens\[2\] = 2 after cu_q_lens\[1\] = 3",
    ),
    (
        "ragged_cu_past_T",
        _ragged([3, 5, 0], RAGGED_TABLES, [0, 2, 7, 7]),
        r"ragged_page_attention: cu_q_lens\[2\] = 7 is outside \[0, T\] = \[0, 6\]",
    ),
    ("ragged_cu_start", _ragged([3, 5, 0], RAGGED_TABLES, [1, 2, 3, 3]), r"cu_q_lens\[0\] = 1 must be 0"),
    (
        "ragged_kv_less_than_q",
        _ragged([1, 5, 0], RAGGED_TABLES, [0, 2, 3, 3]),
        r"ragged_page_attention: kv_lens\[0\] = 1 is less than sequence 0's query length .* = 2",
    ),
    ("ragged_num_seqs_negative", _ragged([3, 5, 0], RAGGED_TABLES, [0, 2, 3, 3], -1), r"num_seqs = -1 must be >= 0"),
    (
        "mla_table_past_P",
        _mla([3, 6], [[0, -1], [1, 4]]),
        r"multi_head_latent_attention: block_tables\[1, 1\] = 4 is not a page",
    ),
    ("mla_table_negative", _mla([3, 6], [[0, -1], [-1, 2]]), r"block_tables\[1, 0\] = -1 is not a page"),
    (
        "mla_lens_past_capacity",
        _mla([3, 10], [[0, -1], [1, 2]]),
        r"cache_seqlens\[1\] = 10 is outside \[0, M \* page\]",
    ),
    ("pool_cu_past_T", _pool([0, 4, 11]), r"mean_pooling: cu_seqlens\[2\] = 11 is outside \[0, T\] = \[0, 10\]"),
    ("pool_cu_negative", _pool([-1, 4, 10]), r"mean_pooling: cu_seqlens\[0\] = -1 is outside \[0, T\]"),
    (
        "pool_cu_decreasing",
        _pool([0, 6, 4, 10]),
        r"mean_pooling: cu_seqlens must be non-decreasing, got cu_seqlens\[2\]",
    ),
    ("gla_cu_decreasing", _linear(gla, [0, 5, 3, 8]), r"gla: cu_seqlens must be non-decreasing"),
    ("gdr_cu_decreasing", _linear(gated_delta_rule, [0, 5, 3, 8]), r"gated_delta_rule: cu_seqlens must be non-decr"),
    ("lightning_cu_past_T", _linear(lightning_attn, [0, 9]), r"lightning_attn: cu_seqlens\[1\] = 9 is outside"),
    ("recurrent_cu_decreasing", _linear(recurrent, [0, 6, 2, 8]), r"recurrent: cu_seqlens must be non-decreasing"),
    (
        "flash_cu_q_decreasing",
        _flash([0, 5, 3, 8], [0, 2, 4, 8]),
        r"flash_attention: cu_seqlens_q must be non-decreasing, got cu_seqlens_q\[2\] = 3 after cu_seqlens_q\[1\] = 5",
    ),
    ("flash_cu_k_past_S", _flash([0, 4, 8], [0, 4, 9]), r"flash_attention: cu_seqlens_k\[2\] = 9 is outside \[0, S\]"),
]
IDS = [b[0] for b in BAD]


def _jitted(fn: Callable[..., Any], static: dict[str, Any]) -> Callable[..., Any]:
    """``fn`` under ``jit`` with every array traced (a fresh function, so every call traces anew)."""
    return jax.jit(lambda arrays: fn(**arrays, **static, platform="reference"))


@pytest.mark.parametrize(("name", "case", "message"), BAD, ids=IDS)
def test_concrete_metadata_is_refused_with_the_first_bad_entry(name, case, message):
    fn, arrays, static = case
    with pytest.raises(ValueError, match=message):
        fn(**arrays, **static)


@pytest.mark.parametrize(("name", "case", "message"), BAD, ids=IDS)
def test_traced_metadata_is_not_checked_by_default(name, case, message, monkeypatch):
    monkeypatch.delenv("EJKERNEL_CHECKS", raising=False)
    fn, arrays, static = case
    jax.block_until_ready(_jitted(fn, static)(arrays))  # wrong but no error: the documented behaviour under jit


@pytest.mark.parametrize(("name", "case", "message"), BAD, ids=IDS)
def test_traced_metadata_is_checked_with_ejkernel_checks(name, case, message, monkeypatch):
    monkeypatch.setenv("EJKERNEL_CHECKS", "1")
    fn, arrays, static = case
    with pytest.raises(jax.errors.JaxRuntimeError, match=message):
        jax.block_until_ready(_jitted(fn, static)(arrays))


GOOD = [
    # Unread table slots hold padding (-1, past the cache); empty sequences.
    ("page", _page([3, 6], [[0, -1], [1, 2]])),
    ("page_padding_past_P", _page([0, 4], [[7, -1], [3, 99]])),
    # Slot 2 is not live: its length, table row and offset are garbage.
    ("ragged", _ragged([3, 5, 1000], RAGGED_TABLES, [0, 2, 3, 99])),
    ("ragged_none_live", _ragged([3, 5, 0], RAGGED_TABLES, [5, 2, 3, 99], 0)),
    ("ragged_decode_and_idle", _ragged([8, 0, 0], [[3, 2], [-1, -1], [-1, -1]], [0, 1, 1, 1], 3)),
    ("mla", _mla([3, 6], [[0, -1], [1, 2]])),
    ("mla_full_and_empty", _mla([8, 0], [[3, 2], [10**6, -1]])),
    ("pool_offset_start", _pool([3, 3, 10])),
    ("gla", _linear(gla, [0, 0, 5, 8])),
    ("flash", _flash([0, 5, 5, 8], [0, 2, 4, 8])),
]


@pytest.mark.parametrize(("name", "case"), GOOD, ids=[g[0] for g in GOOD])
def test_valid_metadata_passes_eagerly_and_under_checked_jit(name, case, monkeypatch):
    fn, arrays, static = case
    eager = fn(**arrays, **static, platform="reference")
    monkeypatch.setenv("EJKERNEL_CHECKS", "1")
    traced = _jitted(fn, static)(arrays)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), eager, traced)


def test_checked_vmap_sees_each_element(monkeypatch):
    """Under vmap the check runs per element: a batch whose second element has a bad table entry fails."""
    monkeypatch.setenv("EJKERNEL_CHECKS", "1")
    _, good, _ = _page([3, 6], [[0, -1], [1, 2]])
    tables = jnp.stack([good["block_tables"], jnp.array([[0, -1], [1, 5]], i32)])

    def one(t: jax.Array) -> jax.Array:
        return page_attention(**{**good, "block_tables": t}, platform="reference")

    jax.block_until_ready(jax.jit(jax.vmap(one))(tables[:1]))
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"block_tables\[1, 1\] = 5 is not a page"):
        jax.block_until_ready(jax.jit(jax.vmap(one))(tables))


def test_int_num_seqs_stays_static_and_is_checked(monkeypatch):
    """A Python int ``num_seqs`` is static under jit; the traced check still uses it to pick the live slots."""
    monkeypatch.setenv("EJKERNEL_CHECKS", "1")
    _, arrays, _ = _ragged([3, 5, 0], RAGGED_TABLES, [0, 2, 3, 9])
    arrays.pop("num_seqs")

    def run(n: int) -> None:
        jax.block_until_ready(jax.jit(lambda a: ragged_page_attention(**a, num_seqs=n, platform="reference"))(arrays))

    run(2)  # cu_q_lens[3] ends slot 2, which is not live
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"cu_q_lens\[3\] = 9 is outside \[0, T\] = \[0, 6\]"):
        run(3)


def test_concrete():
    assert concrete(jnp.arange(3)).tolist() == [0, 1, 2]
    assert concrete(np.int32(4)) == 4 and concrete(4) == 4
    assert concrete(jax.ShapeDtypeStruct((3,), jnp.int32)) is None
    assert concrete(None) is None
    seen = []
    jax.jit(lambda x: seen.append(concrete(x)) or x)(jnp.arange(3))
    assert seen == [None]
