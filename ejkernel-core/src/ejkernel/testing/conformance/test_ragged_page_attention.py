"""Conformance suite of ``ragged_page_attention``: every installed implementation against the reference.

Layout: T query rows, S sequence slots (the first ``num_seqs`` live), H query heads, K kv heads, D head dim,
Dv value dim, P pages of ``page`` tokens, M table columns. A case lists the live sequences as
``(q_len, kv_len)``; padding slots carry garbage lengths and offsets, padding rows follow the live ones.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.modules import ragged_page_attention
from ejkernel.modules.operations.ragged_page_attention import _kernel
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

OP = "ragged_page_attention"


def pytest_generate_tests(metafunc: Any) -> None:
    if "impl" in metafunc.fixturenames:
        metafunc.parametrize("impl", implementations_under_test(metafunc.config, OP))


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    # (q_len, kv_len) of the live sequences: prefill (q == kv), chunked prefill (q < kv), decode (q == 1), idle (0)
    seqs: tuple[tuple[int, int], ...] = ((5, 12), (1, 9), (0, 4), (7, 7), (1, 1))
    pad_slots: int = 2
    pad_rows: int = 3
    num_seqs: str = "array1"  # "array1" ([1], as JAX), "scalar" ([]), "int"
    page: int = 4
    h: int = 4
    k: int = 2
    d: int = 32
    dv: int | None = None
    options: tuple[tuple[str, Any], ...] = ()


CASES = [
    Case("mixed_prefill_decode_gqa"),
    Case(
        "decode_only_mqa_soft_cap",
        seqs=((1, 3), (1, 17), (1, 8), (1, 1)),
        num_seqs="scalar",
        k=1,
        options=(("logits_soft_cap", 2.0), ("softmax_scale", 0.7)),
    ),
    Case("window", seqs=((6, 20), (1, 13), (9, 9)), num_seqs="int", options=(("sliding_window", 4),)),
    Case("prefill_batch_one_page_8", seqs=((13, 13),), pad_slots=0, pad_rows=0, page=8, h=2, k=2, d=64),
    Case("chunked_prefill_page_one_dv", seqs=((3, 10), (2, 2)), page=1, dv=16),
]
# Every case in float32; a lower precision on the cases named here (compiling is what costs time on CI; the GPU
# tier runs bfloat16 at realistic shapes).
DTYPE_CASES = dtype_cases(CASES, {"mixed_prefill_decode_gqa": ("bfloat16", "float16"), "window": ("bfloat16",)})
assert {p.values[1] for p in DTYPE_CASES} == set(DTYPES)
# The GPU tier's realistic shapes: a serving step of 64 sequences on pages of 16 (56 decoding with contexts of
# 1500 to 2100 tokens, 6 chunked prefills of 128 rows, a whole prefill of 517 and an idle one), GQA with 32 query
# and 8 kv heads of 128; and a few sequences with heads of 256.
GPU_SEQS = (
    tuple((1, 1500 + (i * 331) % 600) for i in range(56))
    + tuple((128, 1000 + 173 * i) for i in range(6))
    + ((517, 517), (0, 700))
)
GPU_CASES = [
    Case("gpu_mixed_gqa", seqs=GPU_SEQS, page=16, h=32, k=8, d=128),
    Case("gpu_window_soft_cap", seqs=GPU_SEQS, page=16, h=32, k=8, d=128,
         options=(("sliding_window", 1000), ("logits_soft_cap", 30.0))),
    # head dims of 256 (the prefill tiles' 8-warp, 3-stage plan): prefills of several blocks, a chunked one, decodes
    Case("gpu_prefill_d256", seqs=((300, 300), (1, 900), (64, 700), (1, 1), (0, 40)), page=16, h=8, k=2, d=256),
]  # fmt: skip
GPU_DTYPE_CASES = [pytest.param(c, d, id=f"{c.name}-{d}") for c in GPU_CASES for d in ("bfloat16", "float32")]


def make_inputs(case: Case, dtype: str, key: jax.Array) -> tuple[tuple[Any, ...], dict[str, Any], PagedCache]:
    rng = numpy_rng(key)
    q_lens = [q for q, _ in case.seqs]
    kv_lens = [kv for _, kv in case.seqs]
    cache = paged_cache(
        rng,
        dtype,
        kv_lens + [0] * case.pad_slots,
        page=case.page,
        kv_heads=case.k,
        head_dim=case.d,
        value_dim=case.dv or case.d,
    )
    t = sum(q_lens) + case.pad_rows
    n = len(case.seqs)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).tolist()
    # Padding slots: lengths and offsets that would be wrong if read.
    garbage_kv = rng.integers(0, 10_000, case.pad_slots).tolist()
    garbage_cu = rng.choice(np.array([0, 1, t + 9]), case.pad_slots).tolist()
    num_seqs = {"array1": jnp.array([n], jnp.int32), "scalar": jnp.array(n, jnp.int32), "int": n}[case.num_seqs]
    args = (
        normal(rng, (t, case.h, case.d), dtype),
        cache.key_cache,
        cache.value_cache,
        jnp.asarray(kv_lens + garbage_kv, jnp.int32),
        cache.block_tables,
        jnp.asarray(cu + garbage_cu, jnp.int32),
        num_seqs,
    )
    return args, dict(case.options), cache


def call(impl: Any, *args: Any, **kwargs: Any) -> Any:
    return call_forced(ragged_page_attention, impl, *args, **kwargs)


def skip_if_unsupported(impl: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    _skip_if_unsupported(impl, _kernel, ragged_page_attention, args, kwargs)


def run(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``fn(*args, **kwargs)`` compiled once (an int ``num_seqs`` stays static)."""
    *arrays, num_seqs = args
    return jitted(lambda *a, **kw: fn(*a, num_seqs, **kw), **kwargs)(*arrays)


def reference_in_chunks(args: tuple[Any, ...], kwargs: dict[str, Any], rows: int = 32) -> jax.Array:
    """The reference, ``rows`` query rows per call (it gathers every row's pages densely: a whole serving step at
    once would not fit in memory). Rows are independent: rows ``[a, b)`` of a sequence of ``q_len`` queries over
    ``kv_len`` keys are a sequence of their own, of ``b - a`` queries over ``kv_len - (end - b)`` keys."""
    q, key_cache, value_cache, kv_lens, tables, cu, num_seqs = args
    n = int(np.asarray(num_seqs).reshape(-1)[0])
    cu_np, kv_np, tables_np = np.asarray(cu), np.asarray(kv_lens), np.asarray(tables)
    pieces = []  # (first row, rows, keys, the sequence's table row)
    for s in range(n):
        start, end = int(cu_np[s]), int(cu_np[s + 1])
        pieces += [(a, min(end, a + rows) - a, int(kv_np[s]) - (end - min(end, a + rows)), s)
                   for a in range(start, end, rows)]  # fmt: skip
    calls: list[list[Any]] = [[]]
    for piece in pieces:  # each call takes pieces of ``rows`` rows in all at most: one shape, one compilation
        if sum(p[1] for p in calls[-1]) + piece[1] > rows:
            calls.append([])
        calls[-1].append(piece)
    fn = jitted(reference.ragged_page_attention, **kwargs)
    out = np.zeros(q.shape, np.float32)
    for call_pieces in calls:
        sizes = [p[1] for p in call_pieces]
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
        index = np.concatenate([np.arange(a, a + r) for a, r, _, _ in call_pieces] + [np.zeros(0, int)])
        q_part = jnp.zeros((rows, *q.shape[1:]), q.dtype).at[: len(index)].set(q[index])
        lens = np.zeros(rows, np.int32)
        lens[: len(sizes)] = [p[2] for p in call_pieces]
        table = np.zeros((rows, tables_np.shape[1]), np.int32)
        table[: len(sizes)] = tables_np[[p[3] for p in call_pieces]]
        cu_part = np.full(rows + 1, offsets[-1], np.int32)
        cu_part[: len(offsets)] = offsets
        got = fn(q_part, key_cache, value_cache, jnp.asarray(lens), jnp.asarray(table), jnp.asarray(cu_part),
                 jnp.array([len(sizes)], jnp.int32))  # fmt: skip
        out[index] = np.asarray(got, np.float32)[: len(index)]
    return jnp.asarray(out, q.dtype)


def padding_rows(case: Case) -> np.ndarray:
    return np.arange(sum(q for q, _ in case.seqs) + case.pad_rows) >= sum(q for q, _ in case.seqs)


@pytest.mark.parametrize(("case", "dtype"), DTYPE_CASES)
def test_forward_matches_reference(impl, case, dtype):
    check_case(impl, case, dtype)


@pytest.mark.parametrize(("case", "dtype"), GPU_DTYPE_CASES)
def test_gpu_tier_forward_matches_reference(impl, case, dtype, gpu_tier):
    check_case(impl, case, dtype, reference_in_chunks)


def check_case(impl: Any, case: Case, dtype: str, expected: Any = None) -> None:
    """The output against the reference's (``expected(args, kwargs)``, default the reference in one call); padding
    rows give exact zeros."""
    key, seed = fresh_key()
    args, kwargs, _ = make_inputs(case, dtype, key)
    skip_if_unsupported(impl, args, kwargs)
    out = run(lambda *a, **kw: call(impl, *a, **kw), args, kwargs)
    want = (expected or (lambda a, kw: run(reference.ragged_page_attention, a, kw)))(args, kwargs)
    assert out.dtype == jnp.dtype(dtype), f"output dtype {out.dtype} != input dtype {dtype}"
    assert_close(out, want, FWD_RTOL[dtype], f"{case.name} forward", seed)
    assert np.all(np.asarray(out, np.float32)[padding_rows(case)] == 0), f"padding rows must be zeros (seed {seed})"


FP8_PARAMS = [pytest.param(*c[:4], id=c[4]) for c in FP8_CASES[:2]]  # float8 caches (the third: scales only)


@pytest.mark.parametrize(("dtype", "cache_dtype", "k_scale", "v_scale"), FP8_PARAMS)
def test_float8_cache_and_scales_match_reference(impl, dtype, cache_dtype, k_scale, v_scale):
    check_quantized(impl, Case("fp8"), dtype, cache_dtype, k_scale, v_scale)


def test_gpu_tier_float8_cache(impl, gpu_tier):
    """Prefill and decode rows from an e4m3 cache with per-kv-head scales (8 kv heads)."""
    scales = tuple(0.25 * (i + 1) for i in range(8))
    check_quantized(impl, GPU_CASES[0], "bfloat16", "float8_e4m3fn", 0.5, scales, reference_in_chunks)


def check_quantized(
    impl: Any, case: Case, dtype: str, cache_dtype: str, k_scale: Any, v_scale: Any, expected: Any = None
) -> None:
    key, seed = fresh_key()
    args, kwargs, _ = make_inputs(case, dtype, key)
    args, kwargs = quantized(args, kwargs, cache_dtype, k_scale, v_scale)
    skip_if_unsupported(impl, args, kwargs)
    out = run(lambda *a, **kw: call(impl, *a, **kw), args, kwargs)
    want = (expected or (lambda a, kw: run(reference.ragged_page_attention, a, kw)))(args, kwargs)
    assert out.dtype == jnp.dtype(dtype), f"output dtype {out.dtype} != query dtype {dtype}"
    assert_close(out, want, FWD_RTOL[dtype], f"{case.name} {cache_dtype} cache", seed)


def test_the_reference_in_chunks_is_the_reference():
    """What the GPU tier compares with: the reference a few rows per call (pieces of sequences, several per call)."""
    key, seed = fresh_key()
    args, kwargs, _ = make_inputs(CASES[0], "float32", key)
    want = run(reference.ragged_page_attention, args, kwargs)
    assert_close(reference_in_chunks(args, kwargs, rows=4), want, 1e-6, "in chunks of 4 rows", seed)


def test_every_candidate_config_matches_reference(impl, tier):
    """Each launch configuration the implementation offers the autotuner: items of one row (decode-style) and of
    several that split sequences, key blocks of one page and of several."""
    key, seed = fresh_key()
    case = Case("blocks", seqs=((5, 12), (1, 9), (0, 0), (8, 8), (1, 1)), options=(("sliding_window", 6),))
    args, kwargs, _ = make_inputs(case, "float32", key)
    skip_if_unsupported(impl, args, kwargs)

    def check(cfg, want):
        out = run(lambda *a, **kw: call(impl, *a, cfg=cfg, **kw), args, kwargs)
        assert_close(out, want, FWD_RTOL["float32"], "forward", seed)

    expected = lambda: run(reference.ragged_page_attention, args, kwargs)  # noqa: E731
    check_candidate_configs(impl, _kernel, args, kwargs, check, tier=tier, expected=expected, differentiable=False)


def test_unread_cache_entries_never_leak(impl):
    key, seed = fresh_key()
    case = Case("poison")
    args, kwargs, cache = make_inputs(case, "float32", key)
    skip_if_unsupported(impl, args, kwargs)
    want = run(reference.ragged_page_attention, args, kwargs)
    out = run(lambda *a, **kw: call(impl, *a, **kw), (args[0], *cache.poisoned(), *args[3:]), kwargs)
    assert np.all(np.isfinite(np.asarray(out))), f"NaN from unread cache slots leaked into the output (seed {seed})"
    assert_close(out, want, FWD_RTOL["float32"], "poisoned cache", seed)


def test_no_live_sequence_gives_zeros(impl):
    key, seed = fresh_key()
    args, kwargs, _ = make_inputs(Case("none"), "float32", key)
    args = (*args[:-1], jnp.array([0], jnp.int32))
    skip_if_unsupported(impl, args, kwargs)
    out = run(lambda *a, **kw: call(impl, *a, **kw), args, kwargs)
    assert np.all(np.asarray(out) == 0), f"num_seqs = 0: every row is padding (seed {seed})"


def test_not_differentiable(impl):
    key, seed = fresh_key()
    args, kwargs, _ = make_inputs(Case("grad", seqs=((2, 5), (1, 3))), "float32", key)
    skip_if_unsupported(impl, args, kwargs)
    q, rest = args[0], args[1:]
    with pytest.raises(TypeError, match="ragged_page_attention: not differentiable"):
        jax.grad(lambda q: call(impl, q, *rest).sum())(q)
    with pytest.raises(TypeError, match="ragged_page_attention: not differentiable"):
        jax.jvp(lambda q: call(impl, q, *rest), (q,), (q,))
    w = jax.jit(jax.grad(lambda w: (w * call(impl, jax.lax.stop_gradient(q), *rest)).sum()))(1.0)
    assert np.isfinite(float(w))


def test_jit_and_vmap_agree_with_the_reference(impl):
    key, seed = fresh_key()
    args, _, _ = make_inputs(Case("t", seqs=((4, 9), (1, 6)), pad_slots=1), "float32", key)
    skip_if_unsupported(impl, args, {})
    want = jax.jit(reference.ragged_page_attention)(*args)
    compiled = jax.jit(lambda *a: call(impl, *a))(*args)
    # vmap over two batches sharing the cache: in the second only the first sequence (4 rows) is live.
    q2 = jnp.stack([args[0], args[0]])
    n2 = jnp.array([[2], [1]], jnp.int32)
    mapped = jax.jit(jax.vmap(lambda q, n: call(impl, q, *args[1:6], n)))(q2, n2)
    assert_close(compiled, want, FWD_RTOL["float32"], "jit", seed)
    assert_close(mapped[0], want, FWD_RTOL["float32"], "vmap", seed)
    assert_close(mapped[1, :4], want[:4], FWD_RTOL["float32"], "vmap, one live sequence", seed)
    assert np.all(np.asarray(mapped[1, 4:]) == 0), f"vmap: rows of a sequence past num_seqs must be zeros (seed {seed})"


def _replace(i: int, value: Any) -> Any:
    return lambda args: (*args[:i], value(args[i]), *args[i + 1 :])


BAD_INPUTS = [
    ("query_ndim", _replace(0, lambda q: q[None]), r"query must be 3-D \[T, H, D\]"),
    ("int_query", _replace(0, lambda q: q.astype(jnp.int32)), "query must be float32, bfloat16 or float16"),
    ("dtype_mismatch", _replace(1, lambda k: k.astype(jnp.float16)), "must share a dtype"),
    ("heads", _replace(0, lambda q: q[:, :3]), "multiple of key/value heads K=2"),
    ("head_dim", _replace(0, lambda q: q[..., :8]), "key_cache head dim must equal query head dim"),
    ("value_cache", _replace(2, lambda v: v[:, :2]), r"value_cache must be \[P, page, K, Dv\]"),
    ("kv_lens_float", _replace(3, lambda x: x * 1.0), "kv_lens must be an integer array"),
    ("tables_rows", _replace(4, lambda x: x[:2]), r"block_tables must have shape \[S, M\] = \[3, \*\]"),
    ("tables_float", _replace(4, lambda x: x * 1.0), "block_tables must be an integer array"),
    ("cu_q_lens_length", _replace(5, lambda x: x[:3]), r"cu_q_lens must have shape \[S\+1\] = \[4\]"),
    (
        "num_seqs_shape",
        _replace(6, lambda x: jnp.array([2, 1], jnp.int32)),
        "num_seqs must be an integer array of shape",
    ),
    ("num_seqs_float", _replace(6, lambda x: 2.0), "num_seqs must be an integer array"),
]
BAD_OPTIONS = [
    ("window_zero", {"sliding_window": 0}, "sliding_window must be an int >= 1"),
    ("soft_cap", {"logits_soft_cap": 0.0}, "logits_soft_cap must be a positive"),
    ("scale", {"softmax_scale": [0.5]}, "softmax_scale must be a Python float"),
    ("k_scale_shape", {"k_scale": jnp.ones(3)}, r"k_scale must have shape \[\] or \[K\] = \[2\]"),
    ("v_scale_zero", {"v_scale": 0.0}, "v_scale must be a positive finite"),
    ("unknown_option", {"causal": True}, "causal"),
]


@pytest.mark.parametrize(("name", "make", "message"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_are_refused_with_a_clear_error(impl, name, make, message):
    args = (
        jnp.ones((6, 4, 16)),
        jnp.ones((8, 4, 2, 16)),
        jnp.ones((8, 4, 2, 16)),
        jnp.array([3, 5, 0], jnp.int32),
        jnp.zeros((3, 2), jnp.int32),
        jnp.array([0, 2, 3, 3], jnp.int32),
        jnp.array([2], jnp.int32),
    )
    with pytest.raises((ValueError, TypeError), match=message):
        call(impl, *make(args))


@pytest.mark.parametrize(("name", "options", "message"), BAD_OPTIONS, ids=[b[0] for b in BAD_OPTIONS])
def test_bad_options_are_refused_with_a_clear_error(impl, name, options, message):
    args, _, _ = make_inputs(Case("opts", seqs=((1, 2),), pad_slots=0, pad_rows=0), "float32", jax.random.key(0))
    with pytest.raises((ValueError, TypeError), match=message):
        call(impl, *args, **options)
