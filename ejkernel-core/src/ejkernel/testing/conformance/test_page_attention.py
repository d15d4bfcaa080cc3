"""Conformance suite of ``page_attention``: every installed implementation against the reference.

Layout: N sequences, H query heads, K kv heads, D head dim, Dv value dim, P pages of ``page`` tokens,
M table columns. Pages are shuffled, unused table slots hold garbage (-1, out of range, a foreign page).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.modules import page_attention
from ejkernel.modules.operations.page_attention import _kernel
from ejkernel.testing import reference
from ejkernel.testing.conformance._harness import (
    DTYPES,
    FWD_RTOL,
    assert_close,
    call_forced,
    check_candidate_configs,
    dtype_cases,
    fresh_key,
    implementations_under_test,
    jitted,
)
from ejkernel.testing.conformance._harness import skip_if_unsupported as _skip_if_unsupported
from ejkernel.testing.conformance._paged import FP8_CASES, PagedCache, normal, numpy_rng, paged_cache, quantized

OP = "page_attention"


def pytest_generate_tests(metafunc: Any) -> None:
    if "impl" in metafunc.fixturenames:
        metafunc.parametrize("impl", implementations_under_test(metafunc.config, OP))


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    lens: tuple[int, ...] = (0, 1, 7, 21)  # empty, one token, mid-page, past a page boundary
    page: int = 4
    h: int = 4
    k: int = 2
    d: int = 32
    dv: int | None = None
    options: tuple[tuple[str, Any], ...] = ()


CASES = [
    Case("mixed_lengths_gqa"),
    Case("mqa_soft_cap_scale", h=4, k=1, options=(("logits_soft_cap", 2.0), ("softmax_scale", 0.7))),
    Case("window", lens=(3, 9, 17, 22, 0), options=(("sliding_window", 5),)),
    Case("window_wider_than_context", lens=(2, 6), options=(("sliding_window", 100),)),
    Case("batch_one_mha_page_8", lens=(13,), page=8, h=2, k=2, d=64),
    Case("page_one_dv_differs", lens=(1, 5, 3), page=1, dv=16),
]
# Every case in float32; a lower precision on the cases named here (compiling is what costs time on CI; the GPU
# tier runs bfloat16 at realistic shapes).
DTYPE_CASES = dtype_cases(CASES, {"mixed_lengths_gqa": ("bfloat16", "float16"), "window": ("bfloat16",)})
assert {p.values[1] for p in DTYPE_CASES} == set(DTYPES)
# The GPU tier's realistic shapes: a decode step of 64 sequences of 1500 to 2100 tokens (one empty, one of a
# single token) on pages of 16, GQA with 32 query and 8 kv heads of 128.
GPU_LENS = (0, 1) + tuple(1500 + (i * 331) % 600 for i in range(62))
GPU_CASES = [
    Case("gpu_decode_gqa", lens=GPU_LENS, page=16, h=32, k=8, d=128),
    Case("gpu_window_soft_cap", lens=GPU_LENS, page=16, h=32, k=8, d=128,
         options=(("sliding_window", 1000), ("logits_soft_cap", 30.0))),
]  # fmt: skip
GPU_DTYPE_CASES = [pytest.param(c, d, id=f"{c.name}-{d}") for c in GPU_CASES for d in ("bfloat16", "float32")]


def make_inputs(case: Case, dtype: str, key: jax.Array) -> tuple[tuple[Any, ...], dict[str, Any], PagedCache]:
    rng = numpy_rng(key)
    cache = paged_cache(
        rng, dtype, list(case.lens), page=case.page, kv_heads=case.k, head_dim=case.d, value_dim=case.dv or case.d
    )
    q = normal(rng, (len(case.lens), case.h, case.d), dtype)
    lens = jnp.asarray(case.lens, jnp.int32)
    return (q, cache.key_cache, cache.value_cache, lens, cache.block_tables), dict(case.options), cache


def call(impl: Any, *args: Any, **kwargs: Any) -> Any:
    return call_forced(page_attention, impl, *args, **kwargs)


def skip_if_unsupported(impl: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    _skip_if_unsupported(impl, _kernel, page_attention, args, kwargs)


@pytest.mark.parametrize(("case", "dtype"), DTYPE_CASES)
def test_forward_matches_reference(impl, case, dtype):
    check_case(impl, case, dtype)


@pytest.mark.parametrize(("case", "dtype"), GPU_DTYPE_CASES)
def test_gpu_tier_forward_matches_reference(impl, case, dtype, gpu_tier):
    check_case(impl, case, dtype)


def check_case(impl: Any, case: Case, dtype: str) -> None:
    """The output against the reference's; empty sequences give exact zeros."""
    key, seed = fresh_key()
    args, kwargs, _ = make_inputs(case, dtype, key)
    skip_if_unsupported(impl, args, kwargs)
    out = jitted(lambda *a, **kw: call(impl, *a, **kw), **kwargs)(*args)
    want = jitted(reference.page_attention, **kwargs)(*args)
    assert out.dtype == jnp.dtype(dtype), f"output dtype {out.dtype} != input dtype {dtype}"
    assert_close(out, want, FWD_RTOL[dtype], f"{case.name} forward", seed)
    empty = np.asarray(case.lens) == 0
    assert np.all(np.asarray(out, np.float32)[empty] == 0), f"empty sequences must give exact zeros (seed {seed})"


FP8_PARAMS = [pytest.param(*c[:4], id=c[4]) for c in FP8_CASES]


@pytest.mark.parametrize(("dtype", "cache_dtype", "k_scale", "v_scale"), FP8_PARAMS)
def test_float8_cache_and_scales_match_reference(impl, dtype, cache_dtype, k_scale, v_scale):
    check_quantized(impl, Case("fp8"), dtype, cache_dtype, k_scale, v_scale)


def test_gpu_tier_float8_cache(impl, gpu_tier):
    """A realistic decode step from an e4m3 cache with per-kv-head scales (8 kv heads)."""
    check_quantized(impl, GPU_CASES[0], "bfloat16", "float8_e4m3fn", 0.5, tuple(0.25 * (i + 1) for i in range(8)))


def check_quantized(impl: Any, case: Case, dtype: str, cache_dtype: str, k_scale: Any, v_scale: Any) -> None:
    key, seed = fresh_key()
    args, kwargs = make_inputs(case, dtype, key)[:2]
    args, kwargs = quantized(args, kwargs, cache_dtype, k_scale, v_scale)
    skip_if_unsupported(impl, args, kwargs)
    out = jitted(lambda *a, **kw: call(impl, *a, **kw), **kwargs)(*args)
    want = jitted(reference.page_attention, **kwargs)(*args)
    assert out.dtype == jnp.dtype(dtype), f"output dtype {out.dtype} != query dtype {dtype}"
    assert_close(out, want, FWD_RTOL[dtype], f"{case.name} {cache_dtype} cache", seed)


def test_every_candidate_config_matches_reference(impl, tier):
    """Each launch configuration the implementation offers the autotuner: several chunks of sequences and key
    blocks of several pages, the last past the table's end."""
    key, seed = fresh_key()
    case = Case("blocks", lens=(0, 9, 21, 3, 16), options=(("sliding_window", 10),))
    args, kwargs, _ = make_inputs(case, "float32", key)
    skip_if_unsupported(impl, args, kwargs)

    def check(cfg, want):
        out = jitted(lambda *a, **kw: call(impl, *a, cfg=cfg, **kw), **kwargs)(*args)
        assert_close(out, want, FWD_RTOL["float32"], "forward", seed)

    expected = lambda: jitted(reference.page_attention, **kwargs)(*args)  # noqa: E731
    check_candidate_configs(impl, _kernel, args, kwargs, check, tier=tier, expected=expected, differentiable=False)


def test_unread_cache_entries_never_leak(impl):
    """NaN in every cache slot no sequence reads (the rest of last pages, spare pages) changes nothing."""
    key, seed = fresh_key()
    args, kwargs, cache = make_inputs(Case("poison", lens=(5, 0, 11, 1)), "float32", key)
    skip_if_unsupported(impl, args, kwargs)
    key_cache, value_cache = cache.poisoned()
    out = jitted(lambda *a: call(impl, *a))(args[0], key_cache, value_cache, *args[3:])
    assert np.all(np.isfinite(np.asarray(out))), f"NaN from unread cache slots leaked into the output (seed {seed})"
    assert_close(out, reference.page_attention(*args), FWD_RTOL["float32"], "poisoned cache", seed)


def test_nan_in_what_is_read_stays_nan(impl):
    """A NaN in a query or in a key a sequence reads makes that sequence's output NaN, as in the reference: it must
    not read as a sequence that admitted no key (zeros). Another sequence (and one of length 0) is unaffected."""
    key, seed = fresh_key()
    args, kwargs, cache = make_inputs(Case("nan", lens=(5, 7, 0)), "float32", key)
    skip_if_unsupported(impl, args, kwargs)
    q, key_cache, value_cache, lens, tables = args
    page = key_cache.shape[1]
    key_cache = key_cache.at[tables[1, 6 // page], 6 % page].set(jnp.nan)  # sequence 1's last key
    for name, q_in, kc_in in (("query", q.at[0, 0, 0].set(jnp.nan), args[1]), ("key", q, key_cache)):
        out = np.asarray(call(impl, q_in, kc_in, value_cache, lens, tables))
        nan_row = 0 if name == "query" else 1
        assert np.isnan(out[nan_row]).any(), f"a NaN {name} gave a NaN-free output (seed {seed})"
        assert np.isfinite(np.delete(out, nan_row, axis=0)).all(), f"a NaN {name} leaked into other sequences"
        assert (out[2] == 0).all(), f"the empty sequence is not zeros (seed {seed})"


def test_not_differentiable(impl):
    key, seed = fresh_key()
    args, kwargs, _ = make_inputs(Case("grad", lens=(3, 5)), "float32", key)
    skip_if_unsupported(impl, args, kwargs)
    q, rest = args[0], args[1:]
    with pytest.raises(TypeError, match="page_attention: not differentiable"):
        jax.grad(lambda q: call(impl, q, *rest).sum())(q)
    with pytest.raises(TypeError, match="page_attention: not differentiable"):
        jax.jvp(lambda q: call(impl, q, *rest), (q,), (q,))
    # Inputs under stop_gradient pass: the rest of a computation stays differentiable.
    w = jax.jit(jax.grad(lambda w: (w * call(impl, jax.lax.stop_gradient(q), *rest)).sum()))(1.0)
    assert np.isfinite(float(w))


def test_jit_and_vmap_agree_with_the_reference(impl):
    key, seed = fresh_key()
    args, _, _ = make_inputs(Case("t", lens=(6, 0, 13)), "float32", key)
    skip_if_unsupported(impl, args, {})
    want = jax.jit(reference.page_attention)(*args)
    compiled = jax.jit(lambda *a: call(impl, *a))(*args)
    # vmap over two groups of sequences that share the cache.
    q2, lens2, tables2 = (jnp.stack([x, x[::-1]]) for x in (args[0], args[3], args[4]))
    mapped = jax.jit(jax.vmap(lambda q, n, t: call(impl, q, args[1], args[2], n, t)))(q2, lens2, tables2)
    assert_close(compiled, want, FWD_RTOL["float32"], "jit", seed)
    assert_close(mapped[0], want, FWD_RTOL["float32"], "vmap", seed)
    assert_close(mapped[1], want[::-1], FWD_RTOL["float32"], "vmap reversed", seed)


def _bad(q: Any, kc: Any, vc: Any, lens: Any, tables: Any, **kw: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (q, kc, vc, lens, tables), kw


BAD_INPUTS = [
    ("query_ndim", lambda q, kc, vc, n, t: _bad(q[None], kc, vc, n, t), r"query must be 3-D \[N, H, D\]"),
    ("cache_ndim", lambda q, kc, vc, n, t: _bad(q, kc[0], vc, n, t), r"key_cache must be 4-D \[P, page, K, D\]"),
    ("int_query", lambda q, kc, vc, n, t: _bad(q.astype(jnp.int32), kc, vc, n, t), "query must be float32"),
    (
        "dtype_mismatch",
        lambda q, kc, vc, n, t: _bad(q, kc.astype(jnp.bfloat16), vc, n, t),
        "query, key_cache and value_cache must share a dtype",
    ),
    ("heads", lambda q, kc, vc, n, t: _bad(q[:, :3], kc, vc, n, t), "multiple of key/value heads K=2"),
    (
        "head_dim",
        lambda q, kc, vc, n, t: _bad(q[..., :8], kc, vc, n, t),
        "key_cache head dim must equal query head dim",
    ),
    ("value_pages", lambda q, kc, vc, n, t: _bad(q, kc, vc[:3], n, t), r"value_cache must be \[P, page, K, Dv\]"),
    (
        "lens_float",
        lambda q, kc, vc, n, t: _bad(q, kc, vc, n.astype(jnp.float32), t),
        "context_lens must be an integer",
    ),
    ("lens_shape", lambda q, kc, vc, n, t: _bad(q, kc, vc, n[:1], t), r"context_lens must have shape \[N\] = \[2\]"),
    ("tables_float", lambda q, kc, vc, n, t: _bad(q, kc, vc, n, t * 1.0), "block_tables must be an integer array"),
    ("tables_rows", lambda q, kc, vc, n, t: _bad(q, kc, vc, n, t[:1]), r"block_tables must have shape \[N, M\]"),
    ("tables_empty", lambda q, kc, vc, n, t: _bad(q, kc, vc, n, t[:, :0]), "at least one column"),
    (
        "window_zero",
        lambda q, kc, vc, n, t: _bad(q, kc, vc, n, t, sliding_window=0),
        "sliding_window must be an int >= 1",
    ),
    ("window_pair", lambda q, kc, vc, n, t: _bad(q, kc, vc, n, t, sliding_window=(3, 0)), "sliding_window must be"),
    (
        "window_huge",
        lambda q, kc, vc, n, t: _bad(q, kc, vc, n, t, sliding_window=2**31),
        r"sliding_window must be an int >= 1 and < 2\*\*31",
    ),
    (
        "soft_cap_inf",
        lambda q, kc, vc, n, t: _bad(q, kc, vc, n, t, logits_soft_cap=float("inf")),
        "logits_soft_cap must be a positive finite",
    ),
    (
        "scale_nan",
        lambda q, kc, vc, n, t: _bad(q, kc, vc, n, t, softmax_scale=float("nan")),
        "softmax_scale must be a finite float",
    ),
    (
        "soft_cap",
        lambda q, kc, vc, n, t: _bad(q, kc, vc, n, t, logits_soft_cap=-1.0),
        "logits_soft_cap must be a positive",
    ),
    ("scale", lambda q, kc, vc, n, t: _bad(q, kc, vc, n, t, softmax_scale="x"), "softmax_scale must be a Python float"),
    (
        "fp8_key_only",
        lambda q, kc, vc, n, t: _bad(q, kc.astype(jnp.float8_e4m3fn), vc, n, t),
        "key_cache and value_cache must share a dtype",
    ),
    (
        "k_scale_shape",
        lambda q, kc, vc, n, t: _bad(q, kc, vc, n, t, k_scale=jnp.ones(3)),
        r"k_scale must have shape \[\] or \[K\] = \[2\]",
    ),
    (
        "k_scale_negative",
        lambda q, kc, vc, n, t: _bad(q, kc, vc, n, t, k_scale=-1.0),
        "k_scale must be a positive finite",
    ),
    ("v_scale_zero", lambda q, kc, vc, n, t: _bad(q, kc, vc, n, t, v_scale=jnp.zeros(2)), "v_scale must be > 0"),
    (
        "k_scale_inf",
        lambda q, kc, vc, n, t: _bad(q, kc, vc, n, t, k_scale=jnp.array([1.0, jnp.inf])),
        "k_scale must be > 0 and finite",
    ),
    (
        "v_scale_int",
        lambda q, kc, vc, n, t: _bad(q, kc, vc, n, t, v_scale=jnp.ones(2, jnp.int32)),
        "v_scale must be a float32",
    ),
    ("unknown_option", lambda q, kc, vc, n, t: _bad(q, kc, vc, n, t, causal=True), "causal"),
]


@pytest.mark.parametrize(("name", "make", "message"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_are_refused_with_a_clear_error(impl, name, make, message):
    q = jnp.ones((2, 4, 16))
    kc = vc = jnp.ones((6, 4, 2, 16))
    args, kwargs = make(q, kc, vc, jnp.array([3, 5], jnp.int32), jnp.array([[0, 1], [2, 3]], jnp.int32))
    with pytest.raises((ValueError, TypeError), match=message):
        call(impl, *args, **kwargs)
