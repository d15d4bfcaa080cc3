"""Conformance suite of ``ragged_decode_attention``: every installed implementation against the reference.

Layout: B batch rows, S cache length, H query heads, K kv heads, D head dim, Dv value dim. A case lists
every row's ``(start, end)``: full, interior, empty, reaching past either end of the cache.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.modules import ragged_decode_attention
from ejkernel.modules.operations.ragged_decode_attention import _kernel
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
from ejkernel.testing.conformance._paged import FP8_CASES, normal, numpy_rng, quantized

OP = "ragged_decode_attention"


def pytest_generate_tests(metafunc: Any) -> None:
    if "impl" in metafunc.fixturenames:
        metafunc.parametrize("impl", implementations_under_test(metafunc.config, OP))


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    ranges: tuple[tuple[int, int], ...] = ((0, 37), (5, 6), (12, 12), (20, 3), (30, 37), (-4, 50))
    s: int = 37  # not a multiple of any block
    h: int = 4
    k: int = 2
    d: int = 32
    dv: int | None = None
    options: tuple[tuple[str, Any], ...] = ()


CASES = [
    Case("mixed_ranges_gqa"),
    Case("mqa_soft_cap_scale", k=1, options=(("logits_soft_cap", 2.0), ("softmax_scale", 0.7))),
    Case("window", options=(("sliding_window", 4),)),
    Case("batch_one_mha_length_one", ranges=((0, 1),), s=1, h=2, k=2, d=64),
    Case("dv_differs", ranges=((3, 29), (0, 0), (10, 37)), dv=16),
]
# Every case in float32; a lower precision on the cases named here (compiling is what costs time on CI; the GPU
# tier runs bfloat16 at realistic shapes).
DTYPE_CASES = dtype_cases(CASES, {"mixed_ranges_gqa": ("bfloat16", "float16"), "window": ("bfloat16",)})
assert {p.values[1] for p in DTYPE_CASES} == set(DTYPES)
# The GPU tier's realistic shapes: 64 rows over a cache of 2053 tokens (a multiple of no block), ranges of 1500 to
# 2053 keys plus the edge cases (empty, one key, past either end), GQA with 32 query and 8 kv heads of 128.
GPU_RANGES = ((0, 2053), (5, 6), (12, 12), (-4, 3000), (2000, 2100)) + tuple(
    ((i * 13) % 200, 1700 + (i * 7) % 353) for i in range(59)
)
GPU_CASES = [
    Case("gpu_gqa", ranges=GPU_RANGES, s=2053, h=32, k=8, d=128),
    Case("gpu_window_soft_cap", ranges=GPU_RANGES, s=2053, h=32, k=8, d=128,
         options=(("sliding_window", 1000), ("logits_soft_cap", 30.0))),
]  # fmt: skip
GPU_DTYPE_CASES = [pytest.param(c, d, id=f"{c.name}-{d}") for c in GPU_CASES for d in ("bfloat16", "float32")]


def make_inputs(case: Case, dtype: str, key: jax.Array) -> tuple[tuple[Any, ...], dict[str, Any]]:
    rng = numpy_rng(key)
    b = len(case.ranges)
    q = normal(rng, (b, case.h, case.d), dtype)
    k = normal(rng, (b, case.s, case.k, case.d), dtype)
    v = normal(rng, (b, case.s, case.k, case.dv or case.d), dtype)
    start = jnp.asarray([r[0] for r in case.ranges], jnp.int32)
    end = jnp.asarray([r[1] for r in case.ranges], jnp.int32)
    return (q, k, v, start, end), dict(case.options)


def empty_rows(case: Case) -> np.ndarray:
    return np.array([min(e, case.s) <= max(s, 0) for s, e in case.ranges])


def call(impl: Any, *args: Any, **kwargs: Any) -> Any:
    return call_forced(ragged_decode_attention, impl, *args, **kwargs)


def skip_if_unsupported(impl: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    _skip_if_unsupported(impl, _kernel, ragged_decode_attention, args, kwargs)


@pytest.mark.parametrize(("case", "dtype"), DTYPE_CASES)
def test_forward_matches_reference(impl, case, dtype):
    check_case(impl, case, dtype)


@pytest.mark.parametrize(("case", "dtype"), GPU_DTYPE_CASES)
def test_gpu_tier_forward_matches_reference(impl, case, dtype, gpu_tier):
    check_case(impl, case, dtype)


def check_case(impl: Any, case: Case, dtype: str) -> None:
    """The output against the reference's; empty ranges give exact zeros."""
    key, seed = fresh_key()
    args, kwargs = make_inputs(case, dtype, key)
    skip_if_unsupported(impl, args, kwargs)
    out = jitted(lambda *a, **kw: call(impl, *a, **kw), **kwargs)(*args)
    want = jitted(reference.ragged_decode_attention, **kwargs)(*args)
    assert out.dtype == jnp.dtype(dtype), f"output dtype {out.dtype} != input dtype {dtype}"
    assert_close(out, want, FWD_RTOL[dtype], f"{case.name} forward", seed)
    assert np.all(np.asarray(out, np.float32)[empty_rows(case)] == 0), f"empty ranges must give zeros (seed {seed})"


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
    want = jitted(reference.ragged_decode_attention, **kwargs)(*args)
    assert out.dtype == jnp.dtype(dtype), f"output dtype {out.dtype} != query dtype {dtype}"
    assert_close(out, want, FWD_RTOL[dtype], f"{case.name} {cache_dtype} cache", seed)


def test_every_candidate_config_matches_reference(impl, tier):
    """Each launch configuration the implementation offers the autotuner: several chunks of rows and key blocks,
    the last shifted back to the cache's end."""
    key, seed = fresh_key()
    args, kwargs = make_inputs(Case("blocks", options=(("sliding_window", 9),)), "float32", key)
    skip_if_unsupported(impl, args, kwargs)

    def check(cfg, want):
        out = jitted(lambda *a, **kw: call(impl, *a, cfg=cfg, **kw), **kwargs)(*args)
        assert_close(out, want, FWD_RTOL["float32"], "forward", seed)

    expected = lambda: jitted(reference.ragged_decode_attention, **kwargs)(*args)  # noqa: E731
    check_candidate_configs(impl, _kernel, args, kwargs, check, tier=tier, expected=expected, differentiable=False)


def test_keys_outside_the_range_never_leak(impl):
    key, seed = fresh_key()
    case = Case("poison")
    args, _ = make_inputs(case, "float32", key)
    skip_if_unsupported(impl, args, {})
    q, k, v, start, end = args
    j = np.arange(case.s)[None, :, None, None]
    outside = (j < np.asarray(start)[:, None, None, None]) | (j >= np.asarray(end)[:, None, None, None])
    k_bad, v_bad = (jnp.asarray(np.where(outside, np.nan, np.asarray(x))) for x in (k, v))
    out = jax.jit(lambda *a: call(impl, *a))(q, k_bad, v_bad, start, end)
    assert np.all(np.isfinite(np.asarray(out))), f"NaN outside the ranges leaked into the output (seed {seed})"
    assert_close(out, jax.jit(reference.ragged_decode_attention)(*args), FWD_RTOL["float32"], "poisoned", seed)


def test_not_differentiable(impl):
    key, seed = fresh_key()
    args, _ = make_inputs(Case("grad", ranges=((0, 5), (2, 9)), s=9), "float32", key)
    skip_if_unsupported(impl, args, {})
    q, rest = args[0], args[1:]
    with pytest.raises(TypeError, match="ragged_decode_attention: not differentiable"):
        jax.grad(lambda q: call(impl, q, *rest).sum())(q)
    with pytest.raises(TypeError, match="ragged_decode_attention: not differentiable"):
        jax.grad(lambda v: call(impl, q, rest[0], v, *rest[2:]).sum())(rest[1])
    w = jax.jit(jax.grad(lambda w: (w * call(impl, jax.lax.stop_gradient(q), *rest)).sum()))(1.0)
    assert np.isfinite(float(w))


def test_jit_and_vmap_agree_with_the_reference(impl):
    key, seed = fresh_key()
    args, _ = make_inputs(Case("t", ranges=((0, 11), (4, 4), (2, 17)), s=17), "float32", key)
    skip_if_unsupported(impl, args, {})
    want = jax.jit(reference.ragged_decode_attention)(*args)
    compiled = jax.jit(lambda *a: call(impl, *a))(*args)
    mapped = jax.jit(jax.vmap(lambda *a: call(impl, *a)))(*(x[:, None] for x in args))[:, 0]
    assert_close(compiled, want, FWD_RTOL["float32"], "jit", seed)
    assert_close(mapped, want, FWD_RTOL["float32"], "vmap", seed)


def _replace(i: int, value: Any) -> Any:
    return lambda args: (*args[:i], value(args[i]), *args[i + 1 :])


BAD_INPUTS = [
    ("query_ndim", _replace(0, lambda q: q[:, None]), r"query must be 3-D \[B, H, D\]"),
    ("key_ndim", _replace(1, lambda k: k[0]), r"key must be 4-D \[B, S, K, D\]"),
    ("int_query", _replace(0, lambda q: q.astype(jnp.int32)), "query must be float32, bfloat16 or float16"),
    ("dtype_mismatch", _replace(2, lambda v: v.astype(jnp.bfloat16)), "query, key and value must share a dtype"),
    ("batch", _replace(1, lambda k: k[:1]), "batch sizes differ"),
    ("heads", _replace(0, lambda q: q[:, :3]), "multiple of key/value heads K=2"),
    ("head_dim", _replace(1, lambda k: k[..., :8]), "key head dim must equal query head dim"),
    ("value_length", _replace(2, lambda v: v[:, :4]), r"value must be \[B, S, K, Dv\]"),
    ("start_float", _replace(3, lambda x: x * 1.0), "sequence_start must be an integer array"),
    ("end_shape", _replace(4, lambda x: x[:1]), r"sequence_end must have shape \[B\] = \[2\]"),
    ("fp8_value_only", _replace(2, lambda v: v.astype(jnp.float8_e5m2)), "key and value must share a dtype"),
]
BAD_OPTIONS = [
    ("window_negative", {"sliding_window": -3}, "sliding_window must be an int >= 1"),
    ("window_bool", {"sliding_window": True}, "sliding_window must be an int >= 1"),
    ("soft_cap", {"logits_soft_cap": -2.0}, "logits_soft_cap must be a positive"),
    ("scale", {"softmax_scale": "0.5"}, "softmax_scale must be a Python float"),
    ("k_scale_shape", {"k_scale": jnp.ones((2, 1))}, r"k_scale must have shape \[\] or \[K\] = \[2\]"),
    ("k_scale_inf", {"k_scale": float("inf")}, "k_scale must be a positive finite"),
    ("v_scale_negative", {"v_scale": jnp.array([1.0, -1.0])}, "v_scale must be > 0"),
    ("v_scale_str", {"v_scale": "1"}, "v_scale must be a positive float"),
    ("unknown_option", {"causal": True}, "causal"),
]


@pytest.mark.parametrize(("name", "make", "message"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_are_refused_with_a_clear_error(impl, name, make, message):
    args = (
        jnp.ones((2, 4, 16)),
        jnp.ones((2, 8, 2, 16)),
        jnp.ones((2, 8, 2, 16)),
        jnp.array([0, 2], jnp.int32),
        jnp.array([8, 5], jnp.int32),
    )
    with pytest.raises((ValueError, TypeError), match=message):
        call(impl, *make(args))


@pytest.mark.parametrize(("name", "options", "message"), BAD_OPTIONS, ids=[b[0] for b in BAD_OPTIONS])
def test_bad_options_are_refused_with_a_clear_error(impl, name, options, message):
    args = (jnp.ones((2, 4, 16)), jnp.ones((2, 8, 2, 16)), jnp.ones((2, 8, 2, 16)), jnp.zeros(2, int), jnp.ones(2, int))
    with pytest.raises((ValueError, TypeError), match=message):
        call(impl, *args, **options)
