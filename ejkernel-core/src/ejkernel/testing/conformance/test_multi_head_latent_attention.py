"""Conformance suite of ``multi_head_latent_attention`` (alias ``flash_mla``): every installed implementation
against the reference.

Layout: B batch, T query length, S key length, H query heads, Dl latent (value) dim, Dr rotary dim,
D = Dl + Dr; paged: P pages of ``page`` tokens, maxp pages per sequence, L_b keys of batch b.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from ejkernel.modules import flash_mla, multi_head_latent_attention
from ejkernel.modules.operations.multi_head_latent_attention import _kernel
from ejkernel.testing import reference
from ejkernel.testing.conformance._harness import (
    DTYPES,
    FWD_RTOL,
    GRAD_RTOL,
    assert_close,
    call_forced,
    check_candidate_configs,
    fresh_key,
    implementations_under_test,
    jitted,
)
from ejkernel.testing.conformance._harness import skip_if_unsupported as _skip_if_unsupported

OP = "multi_head_latent_attention"


def pytest_generate_tests(metafunc: Any) -> None:
    if "impl" in metafunc.fixturenames:
        metafunc.parametrize("impl", implementations_under_test(metafunc.config, OP))


@dataclasses.dataclass(frozen=True)
class Case:
    """One call shape plus options. Paged when ``lens`` (``cache_seqlens``) is given: batch 0's keys are
    spread over the cache, ``shared`` of batch 1's first pages are batch 0's (a shared prefix), and table
    entries past the pages in use hold garbage (they must not be read)."""

    name: str
    b: int = 2
    t: int = 13  # deliberately not a multiple of any block size
    s: int = 29
    h: int = 4
    dl: int = 32
    dr: int = 16
    causal: bool = False
    softmax_scale: float | None = None
    infer_latent_dim: bool = False  # leave latent_dim out (D must be 576)
    lens: tuple[int, ...] | None = None
    page: int = 8
    shared: int = 0


CASES = [
    Case("dense"),
    Case("dense_causal_t_gt_s_scale", t=29, s=13, causal=True, softmax_scale=0.3),  # 16 rows see no key
    Case("dense_decode_causal", t=1, s=45, causal=True),
    Case("dense_no_rotary_dims", t=7, s=9, dr=0),
    Case("deepseek_dims_latent_inferred", b=1, t=3, s=11, h=2, dl=512, dr=64, infer_latent_dim=True),
    Case("batch_one_length_one", b=1, t=1, s=1, causal=True),
    Case("paged_decode_zero_length", t=1, lens=(29, 0)),
    Case("paged_causal_shared_prefix", t=4, lens=(37, 21), causal=True, shared=2),
    Case("paged_causal_rows_without_keys", t=9, lens=(5, 17), causal=True, page=4),
    # A decode step as decode kernels take it: 2 queries, 16 heads, an empty row, pages that split the lengths.
    Case("paged_decode_causal_t2_heads16", b=3, t=2, h=16, dl=64, dr=16, lens=(45, 0, 19), causal=True, page=16),
]


def make_inputs(case: Case, dtype: str, key: jax.Array) -> tuple[tuple[Any, ...], dict[str, Any]]:
    kq, kk, kp = jax.random.split(key, 3)
    d = case.dl + case.dr
    q = jax.random.normal(kq, (case.b, case.t, case.h, d), jnp.float32).astype(dtype)
    kwargs: dict[str, Any] = {"causal": case.causal}
    if not case.infer_latent_dim:
        kwargs["latent_dim"] = case.dl
    if case.softmax_scale is not None:
        kwargs["softmax_scale"] = case.softmax_scale
    if case.lens is None:
        kv = jax.random.normal(kk, (case.b, case.s, d), jnp.float32).astype(dtype)
        return (q, kv), kwargs
    maxp = -(-max(case.lens) // case.page) + 1  # one entry more than the longest sequence needs
    num_pages = case.b * maxp + 3  # some pages belong to no sequence
    kv = jax.random.normal(kk, (num_pages, case.page, d), jnp.float32).astype(dtype)
    tables = np.array(jax.random.permutation(kp, num_pages))[: case.b * maxp].reshape(case.b, maxp)
    tables[1, : case.shared] = tables[0, : case.shared]
    for b, n in enumerate(case.lens):
        tables[b, -(-n // case.page) :] = (-1, 10**6)[b % 2]  # past the pages in use: garbage
    kwargs["block_tables"] = jnp.asarray(tables, jnp.int32)
    kwargs["cache_seqlens"] = jnp.asarray(case.lens, jnp.int32)
    return (q, kv), kwargs


def call(impl: Any, *args: Any, **kwargs: Any) -> Any:
    return call_forced(multi_head_latent_attention, impl, *args, **kwargs)


def skip_if_unsupported(impl: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    _skip_if_unsupported(impl, _kernel, multi_head_latent_attention, args, kwargs)


# Every case in float32; the half-precision dtypes on the cases that cover the kernel's paths (dense and
# paged, causal, the DeepSeek dims), which keeps the suite's compile time within the CI budget.
HALF_PRECISION_CASES = ("dense_causal_t_gt_s_scale", "deepseek_dims_latent_inferred", "paged_causal_shared_prefix")
CASE_DTYPES = [
    pytest.param(c, d, id=f"{c.name}-{d}")
    for c in CASES
    for d in DTYPES
    if d == "float32" or c.name in HALF_PRECISION_CASES
]
# The GPU tier's realistic shapes: DeepSeek's dims, lengths of many blocks, a multiple of none; paged decoding of 64
# sequences of 1000 to 2100 tokens and a chunked prefill over a shared prefix, on pages of 64; a decode step with
# DeepSeek-V3's 128 heads.
GPU_CASES = [
    Case("gpu_dense_causal", t=1031, s=1031, h=16, dl=512, dr=64, causal=True),
    Case("gpu_paged_decode", b=64, t=1, h=16, dl=512, dr=64, lens=tuple(1000 + (i * 397) % 1100 for i in range(64)),
         page=64),
    Case("gpu_paged_prefill_shared_prefix", b=4, t=257, h=16, dl=512, dr=64, lens=(2053, 1700, 1031, 300),
         causal=True, page=64, shared=8),
    Case("gpu_paged_decode_deepseek_heads", b=4, t=1, h=128, dl=512, dr=64, lens=(1000,) * 4, causal=True, page=64),
]  # fmt: skip
GPU_DTYPE_CASES = [pytest.param(c, d, id=f"{c.name}-{d}") for c in GPU_CASES for d in ("bfloat16", "float32")]


def _value_and_grads(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], cot: jax.Array) -> Any:
    """``((dq, dkv), out)`` of ``fn``: the output and the gradients in query and kv of ``sum(out * cot)``, in one
    compiled call."""

    def loss(q, kv, **kw):
        out = fn(q, kv, **kw)
        return jnp.sum(out.astype(jnp.float32) * cot), out

    return jitted(lambda q, kv, **kw: jax.grad(loss, argnums=(0, 1), has_aux=True)(q, kv, **kw), **kwargs)(*args)


def _assert_matches(got: Any, want: Any, dtype: str, what: str, seed: int) -> None:
    (dq, dkv), out = got
    (want_dq, want_dkv), want_out = want
    assert out.dtype == jnp.dtype(dtype), f"output dtype {out.dtype} != input dtype {dtype}"
    assert_close(out, want_out, FWD_RTOL[dtype], f"{what} forward", seed)
    for name, g, w in (("dq", dq, want_dq), ("dkv", dkv, want_dkv)):
        assert g.dtype == w.dtype, f"{name} dtype {g.dtype} != {w.dtype}"
        assert_close(g, w, GRAD_RTOL[dtype], f"{what} {name}", seed)


@pytest.mark.parametrize(("case", "dtype"), CASE_DTYPES)
def test_forward_and_gradients_match_reference(impl, case, dtype):
    """Output and the gradients in query and kv (key and value role of the latent; a paged cache at the slots
    read), in one compiled call per side."""
    check_case(impl, case, dtype)


@pytest.mark.parametrize(("case", "dtype"), GPU_DTYPE_CASES)
def test_gpu_tier_forward_and_gradients_match_reference(impl, case, dtype, gpu_tier):
    check_case(impl, case, dtype)


def check_case(impl: Any, case: Case, dtype: str) -> None:
    key, seed = fresh_key()
    args, kwargs = make_inputs(case, dtype, key)
    skip_if_unsupported(impl, args, kwargs)
    cot = jax.random.normal(jax.random.fold_in(key, 1), (case.b, case.t, case.h, case.dl), jnp.float32)
    got = _value_and_grads(lambda *a, **kw: call(impl, *a, **kw), args, kwargs, cot)
    want = _value_and_grads(reference.multi_head_latent_attention, args, kwargs, cot)
    _assert_matches(got, want, dtype, case.name, seed)


def test_every_candidate_config_matches_reference(impl, tier):
    """Each launch configuration the implementation offers the autotuner: lengths of several tiles of each (paged,
    the path with more to get wrong; a few queries, which decode kernels take too)."""
    case = Case("paged_causal_shared_prefix", t=9, lens=(277, 45), causal=True, page=8, shared=2)
    key, seed = fresh_key()
    args, kwargs = make_inputs(case, "float32", key)
    skip_if_unsupported(impl, args, kwargs)
    cot = jax.random.normal(jax.random.fold_in(key, 1), (case.b, case.t, case.h, case.dl), jnp.float32)

    def check(cfg, want):
        got = _value_and_grads(lambda *a, **kw: call(impl, *a, cfg=cfg, **kw), args, kwargs, cot)
        _assert_matches(got, want, "float32", case.name, seed)

    expected = lambda: _value_and_grads(reference.multi_head_latent_attention, args, kwargs, cot)  # noqa: E731
    check_candidate_configs(impl, _kernel, args, kwargs, check, tier=tier, expected=expected)


def test_paged_matches_dense_on_the_same_keys(impl):
    """Each batch of a paged call equals a dense call of the reference on that batch's keys, gathered by hand."""
    key, seed = fresh_key()
    lens = (27, 12)
    case = Case("paged", t=5, h=3, lens=lens, causal=True, page=4, shared=1)
    args, kwargs = make_inputs(case, "float32", key)
    skip_if_unsupported(impl, args, kwargs)
    out = jitted(lambda *a, **kw: call(impl, *a, **kw), **kwargs)(*args)
    q, cache = args
    tables = np.asarray(kwargs["block_tables"])
    for b, n in enumerate(lens):
        keys = jnp.concatenate([cache[p] for p in tables[b, : -(-n // case.page)]])[None, :n]
        want = jitted(reference.multi_head_latent_attention, latent_dim=case.dl, causal=True)(q[b : b + 1], keys)
        assert_close(out[b : b + 1], want, FWD_RTOL["float32"], f"batch {b} vs dense", seed)


@pytest.mark.parametrize(
    "small",
    [
        Case("dense_causal_t_gt_s", b=1, t=7, s=5, h=2, dl=8, dr=4, causal=True, softmax_scale=0.3),
        Case("paged_causal_shared_prefix", t=3, h=2, dl=8, dr=4, lens=(9, 6), causal=True, page=4, shared=1),
    ],
    ids=lambda c: c.name,
)
def test_check_grads_numerically(impl, small):
    key, seed = fresh_key()
    args, kwargs = make_inputs(small, "float32", key)
    skip_if_unsupported(impl, args, kwargs)
    with jax.enable_x64(False):
        check_grads(
            jax.jit(lambda *a: call(impl, *a, **kwargs)), args, order=1, modes=("rev",), atol=3e-2, rtol=3e-2, eps=1e-2
        )


def test_rows_without_keys_give_zeros_and_zero_gradients(impl):
    """An empty cache (L_b = 0) and causal rows before the first key: zeros, finite gradients, dq zero there."""
    key, seed = fresh_key()
    case = Case("empty", t=6, h=2, dl=8, dr=8, lens=(3, 0), causal=True, page=4)
    args, kwargs = make_inputs(case, "float32", key)
    skip_if_unsupported(impl, args, kwargs)
    out, vjp = jax.vjp(jax.jit(lambda q, kv: call(impl, q, kv, **kwargs)), *args)
    assert np.all(np.isfinite(out)), f"NaN/inf in the output (seed {seed})"
    assert np.all(np.asarray(out[1]) == 0), "an empty cache must give exactly zeros"
    assert np.all(np.asarray(out[0, :3]) == 0), "causal rows i < T - L see no key and must be zeros"
    assert np.any(np.asarray(out[0, 3:]) != 0)
    dq, dkv = vjp(jnp.ones_like(out))
    for name, g in (("dq", dq), ("dkv", dkv)):
        assert np.all(np.isfinite(g)), f"{name} has NaN/inf (seed {seed})"
    assert np.all(np.asarray(dq[1]) == 0) and np.all(np.asarray(dq[0, :3]) == 0)
    read = np.asarray(kwargs["block_tables"])[0, 0]
    unread = np.setdiff1d(np.arange(args[1].shape[0]), [read])
    assert np.all(np.asarray(dkv[unread]) == 0), "cache pages no batch reads get zero gradient"


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_jit_and_vmap_agree_with_eager(impl, paged):
    key, seed = fresh_key()
    case = Case("t", t=3, s=11, h=2, dl=16, dr=8, causal=True, lens=(11, 6) if paged else None, page=4)
    args, kwargs = make_inputs(case, "float32", key)
    skip_if_unsupported(impl, args, kwargs)
    arrays = {k: v for k, v in kwargs.items() if isinstance(v, jax.Array)}
    static = {k: v for k, v in kwargs.items() if k not in arrays}
    eager = call(impl, *args, **kwargs)
    jit = jax.jit(lambda *a: call(impl, *a, **kwargs))(*args)
    # vmap over a new leading axis of every array (the cache too: one cache per mapped call).

    def one(q: Any, kv: Any, arr: dict[str, Any]) -> Any:
        return call(impl, q, kv, **arr, **static)

    q, kv = args
    mapped = jax.vmap(one)(q[None], kv[None], {k: v[None] for k, v in arrays.items()})[0]
    assert_close(jit, eager, 1e-6, "jit", seed)
    assert_close(mapped, eager, 1e-5, "vmap", seed)


def test_flash_mla_is_the_same_function(impl):
    key, seed = fresh_key()
    args, kwargs = make_inputs(Case("alias", t=2, s=5, h=2, dl=8, dr=8), "float32", key)
    assert flash_mla is multi_head_latent_attention
    np.testing.assert_array_equal(
        np.asarray(call_forced(flash_mla, impl, *args, **kwargs)), np.asarray(call(impl, *args, **kwargs))
    )


def _paged(q: Any, kv: Any) -> dict[str, Any]:
    return {"block_tables": jnp.zeros((2, 3), jnp.int32), "cache_seqlens": jnp.zeros((2,), jnp.int32)}


BAD_INPUTS = [
    ("query_ndim", lambda q, kv: ((q[0], kv), {"latent_dim": 16}), r"query must be 4-D \[B, T, H, D\]"),
    ("kv_per_head", lambda q, kv: ((q, kv[:, :, None]), {"latent_dim": 16}), "kv must be 3-D"),
    ("int_query", lambda q, kv: ((q.astype(jnp.int32), kv), {"latent_dim": 16}), "query must be float32"),
    ("dtype_mismatch", lambda q, kv: ((q, kv.astype(jnp.float16)), {"latent_dim": 16}), "must share a dtype"),
    ("dim_mismatch", lambda q, kv: ((q, kv[..., :20]), {"latent_dim": 16}), "kv's last dim must equal"),
    ("latent_dim_missing", lambda q, kv: ((q, kv), {}), "latent_dim is required unless the last dim"),
    ("latent_dim_too_big", lambda q, kv: ((q, kv), {"latent_dim": 25}), r"latent_dim must be in \[1, 24\]"),
    ("latent_dim_float", lambda q, kv: ((q, kv), {"latent_dim": 16.0}), "latent_dim must be an int"),
    ("batch", lambda q, kv: ((q, kv[:1]), {"latent_dim": 16}), r"kv must be \[B, S, D\] with the batch B=2"),
    (
        "tables_only",
        lambda q, kv: ((q, kv), {"latent_dim": 16, "block_tables": _paged(q, kv)["block_tables"]}),
        "needs both block_tables and cache_seqlens, got only block_tables",
    ),
    (
        "tables_float",
        lambda q, kv: ((q, kv), {"latent_dim": 16, **_paged(q, kv), "block_tables": jnp.zeros((2, 3))}),
        r"block_tables must be an integer array \[B, maxp\]",
    ),
    (
        "seqlens_shape",
        lambda q, kv: ((q, kv), {"latent_dim": 16, **_paged(q, kv), "cache_seqlens": jnp.zeros((3,), jnp.int32)}),
        r"cache_seqlens must be an integer array \[B\] with B=2",
    ),
    ("scale_array", lambda q, kv: ((q, kv), {"latent_dim": 16, "softmax_scale": jnp.ones(())}), "softmax_scale must"),
    ("causal_int", lambda q, kv: ((q, kv), {"latent_dim": 16, "causal": 1}), "causal must be a bool"),
    ("unknown_option", lambda q, kv: ((q, kv), {"latent_dim": 16, "casual": True}), "casual"),
]


@pytest.mark.parametrize(("name", "make", "message"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_are_refused_with_a_clear_error(impl, name, make, message):
    q = jnp.ones((2, 8, 4, 24))
    kv = jnp.ones((2, 8, 24))
    args, kwargs = make(q, kv)
    with pytest.raises((ValueError, TypeError), match=message):
        call(impl, *args, **kwargs)
