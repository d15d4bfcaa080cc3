"""Conformance suite of ``flash_attention``: every installed implementation against the reference.

Layout: B batch, T query length, S key length, H query heads, K kv heads, D head dim, Dv value dim.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from ejkernel.modules import flash_attention
from ejkernel.modules.operations.flash_attention import _kernel
from ejkernel.testing import reference
from ejkernel.testing.conformance._harness import (
    DTYPES,
    FWD_RTOL,
    GRAD_RTOL,
    assert_close,
    call_forced,
    fresh_key,
    implementations_under_test,
    jitted,
)
from ejkernel.testing.conformance._harness import skip_if_unsupported as _skip_if_unsupported

OP = "flash_attention"


def pytest_generate_tests(metafunc: Any) -> None:
    if "impl" in metafunc.fixturenames:
        metafunc.parametrize("impl", implementations_under_test(metafunc.config, OP))


@dataclasses.dataclass(frozen=True)
class Case:
    """One call shape plus options; ``arrays`` names extra array inputs the case builds."""

    name: str
    b: int = 2
    t: int = 37  # deliberately not a multiple of any block size
    s: int = 53
    h: int = 4
    k: int = 2
    d: int = 32
    dv: int | None = None
    options: tuple[tuple[str, Any], ...] = ()
    arrays: tuple[str, ...] = ()


CASES = [
    Case("plain"),
    Case("gqa_causal", options=(("causal", True),)),
    Case("causal_t_gt_s", t=53, s=37, options=(("causal", True),)),
    Case("mha_equal_lengths_causal", t=48, s=48, h=3, k=3, options=(("causal", True),)),
    Case("mqa", h=4, k=1),
    Case("window_int", options=(("sliding_window", 5),)),
    Case("window_left_right_causal", options=(("sliding_window", (7, 0)), ("causal", True))),
    Case("window_asymmetric", options=(("sliding_window", (3, 9)),)),
    Case("soft_cap", options=(("logits_soft_cap", 2.0), ("softmax_scale", 0.7))),
    Case("bias_full", arrays=("bias_full",)),
    Case("bias_broadcast_batch", arrays=("bias_heads",)),
    Case("attention_mask", arrays=("attention_mask",)),
    Case("segment_ids", arrays=("segment_ids",), options=(("causal", True),)),
    Case("dropout", options=(("dropout_prob", 0.25), ("dropout_seed", 1234))),
    Case("varlen_causal", b=1, t=41, s=57, arrays=("cu_seqlens",), options=(("causal", True),)),
    Case("dv_differs", d=32, dv=48),
    Case("length_one_query", t=1, s=29, options=(("causal", True),)),
    Case("length_one_both", t=1, s=1),
    Case("batch_one_head_dim_64", b=1, t=20, s=20, h=2, k=2, d=64, options=(("causal", True),)),
]


def make_inputs(case: Case, dtype: str, key: jax.Array) -> tuple[tuple[Any, ...], dict[str, Any]]:
    kq, kk, kv, kb, km = jax.random.split(key, 5)
    dv = case.dv or case.d
    q = jax.random.normal(kq, (case.b, case.t, case.h, case.d), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (case.b, case.s, case.k, case.d), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (case.b, case.s, case.k, dv), jnp.float32).astype(dtype)
    kwargs: dict[str, Any] = dict(case.options)
    bias = None
    for name in case.arrays:
        if name == "bias_full":
            bias = jax.random.normal(kb, (case.b, case.h, case.t, case.s), jnp.float32).astype(dtype)
        elif name == "bias_heads":
            bias = jax.random.normal(kb, (1, case.h, case.t, case.s), jnp.float32).astype(dtype)
        elif name == "attention_mask":
            mask = jax.random.bernoulli(km, 0.7, (case.b, 1, case.t, case.s))
            kwargs["attention_mask"] = mask.at[0, 0, 3, :].set(False)  # one fully masked row
        elif name == "segment_ids":
            qs = jnp.sort(jax.random.randint(km, (case.b, case.t), 0, 3), axis=-1)
            ks = jnp.sort(jax.random.randint(kb, (case.b, case.s), 0, 3), axis=-1)
            kwargs["q_segment_ids"], kwargs["kv_segment_ids"] = qs.at[:, -1].set(7), ks  # segment 7: no keys
        elif name == "cu_seqlens":
            # Three sequences, the middle one empty on the query side.
            kwargs["cu_seqlens_q"] = jnp.array([0, 17, 17, case.t], jnp.int32)
            kwargs["cu_seqlens_k"] = jnp.array([0, 20, 31, case.s], jnp.int32)
    args = (q, k, v) if bias is None else (q, k, v, bias)
    return args, kwargs


def call(impl: Any, *args: Any, **kwargs: Any) -> Any:
    return call_forced(flash_attention, impl, *args, **kwargs)


def skip_if_unsupported(impl: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    _skip_if_unsupported(impl, _kernel, flash_attention, args, kwargs)


def _float_args(args: tuple[Any, ...]) -> tuple[int, ...]:
    return tuple(range(len(args)))  # q, k, v and bias are all differentiable


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_forward_matches_reference(impl, case, dtype):
    key, seed = fresh_key()
    args, kwargs = make_inputs(case, dtype, key)
    skip_if_unsupported(impl, args, kwargs)
    out = jitted(lambda *a, **kw: call(impl, *a, **kw), **kwargs)(*args)
    want = jitted(reference.flash_attention, **kwargs)(*args)
    assert out.dtype == jnp.dtype(dtype), f"output dtype {out.dtype} != input dtype {dtype}"
    assert_close(out, want, FWD_RTOL[dtype], f"{case.name} forward", seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gradients_match_reference(impl, case, dtype):
    key, seed = fresh_key()
    args, kwargs = make_inputs(case, dtype, key)
    skip_if_unsupported(impl, args, kwargs)
    cot = jax.random.normal(jax.random.fold_in(key, 1), (case.b, case.t, case.h, case.dv or case.d)).astype(dtype)
    argnums = _float_args(args)

    def grads(fn):
        loss = lambda *a, **kw: jnp.sum(fn(*a, **kw).astype(jnp.float32) * cot.astype(jnp.float32))  # noqa: E731
        return jitted(lambda *a, **kw: jax.grad(lambda *x: loss(*x, **kw), argnums=argnums)(*a), **kwargs)(*args)

    got = grads(lambda *a, **kw: call(impl, *a, **kw))
    want = grads(reference.flash_attention)
    for name, g, w in zip(("dq", "dk", "dv", "dbias"), got, want, strict=False):
        assert g.dtype == w.dtype, f"{name} dtype {g.dtype} != {w.dtype}"
        assert_close(g, w, GRAD_RTOL[dtype], f"{case.name} {name}", seed)


@pytest.mark.parametrize(
    "case",
    [c for c in CASES if c.name in ("gqa_causal", "soft_cap", "bias_full", "window_asymmetric")],
    ids=lambda c: c.name,
)
def test_check_grads_numerically(impl, case):
    small = dataclasses.replace(case, b=1, t=7, s=9, h=2, k=1, d=8)
    key, seed = fresh_key()
    args, kwargs = make_inputs(small, "float32", key)
    skip_if_unsupported(impl, args, kwargs)
    with jax.enable_x64(False):
        check_grads(lambda *a: call(impl, *a, **kwargs), args, order=1, modes=("rev",), atol=3e-2, rtol=3e-2, eps=1e-2)


def test_fully_masked_rows_give_zeros_and_zero_gradients(impl):
    key, seed = fresh_key()
    case = Case("masked", b=1, t=9, s=11, h=2, k=2, d=16)
    args, _ = make_inputs(case, "float32", key)
    mask = jnp.ones((1, 1, 9, 11), bool).at[:, :, 2].set(False).at[:, :, 5].set(False)
    skip_if_unsupported(impl, args, {"attention_mask": mask})
    out, vjp = jax.vjp(lambda q, k, v: call(impl, q, k, v, attention_mask=mask), *args)
    assert np.all(np.isfinite(out)), f"NaN/inf in the output (seed {seed})"
    assert np.all(np.asarray(out[:, [2, 5]]) == 0), "fully masked rows must be exactly zero"
    dq, dk, dv = vjp(jnp.ones_like(out))
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert np.all(np.isfinite(g)), f"{name} has NaN/inf (seed {seed})"
    assert np.all(np.asarray(dq[:, [2, 5]]) == 0)


def test_dropout_is_deterministic_per_seed(impl):
    key, seed = fresh_key()
    args, _ = make_inputs(Case("d", b=1, t=16, s=16, h=2, k=2, d=16), "float32", key)
    kw = {"dropout_prob": 0.5}
    skip_if_unsupported(impl, args, {**kw, "dropout_seed": 1})
    a = call(impl, *args, **kw, dropout_seed=1)
    b = call(impl, *args, **kw, dropout_seed=1)
    c = call(impl, *args, **kw, dropout_seed=jnp.asarray(2, jnp.int32))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.allclose(np.asarray(a), np.asarray(c)), "a different seed must give a different mask"


def test_jit_and_vmap_agree_with_eager(impl):
    key, seed = fresh_key()
    args, kwargs = make_inputs(Case("t", b=2, t=19, s=23, h=2, k=1, d=16), "float32", key)
    skip_if_unsupported(impl, args, {"causal": True})
    eager = call(impl, *args, causal=True)
    jitted = jax.jit(lambda *a: call(impl, *a, causal=True))(*args)
    vmapped = jax.vmap(lambda *a: call(impl, *a, causal=True))(*(x[:, None] for x in args))[:, 0]
    assert_close(jitted, eager, 1e-6, "jit", seed)
    assert_close(vmapped, eager, 1e-5, "vmap", seed)


BAD_INPUTS = [
    ("query_ndim", lambda q, k, v: ((q[0], k, v), {}), "query must be 4-D"),
    ("dtype_mismatch", lambda q, k, v: ((q, k.astype(jnp.bfloat16), v), {}), "must share a dtype"),
    ("int_query", lambda q, k, v: ((q.astype(jnp.int32), k, v), {}), "query must be float32, bfloat16 or float16"),
    ("heads", lambda q, k, v: ((q[:, :, :3], k, v), {}), "multiple of key/value heads"),
    ("head_dim", lambda q, k, v: ((q, k[..., :8], v), {}), "key head dim must equal query head dim"),
    (
        "bias_shape",
        lambda q, k, v: ((q, k, v, jnp.zeros((2, 4, 5, 5))), {}),
        r"bias must have shape \[B\|1, H\|1, T, S\]",
    ),
    (
        "mask_dtype",
        lambda q, k, v: ((q, k, v), {"attention_mask": jnp.ones((1, 1, 8, 8))}),
        "attention_mask must be bool",
    ),
    ("dropout_seed", lambda q, k, v: ((q, k, v), {"dropout_prob": 0.1}), "needs dropout_seed"),
    (
        "dropout_prob",
        lambda q, k, v: ((q, k, v), {"dropout_prob": 1.0, "dropout_seed": 0}),
        r"dropout_prob must be a float in \[0, 1\)",
    ),
    ("window", lambda q, k, v: ((q, k, v), {"sliding_window": (-1, 2)}), "sliding_window must be"),
    ("soft_cap", lambda q, k, v: ((q, k, v), {"logits_soft_cap": 0.0}), "logits_soft_cap must be a positive"),
    (
        "segments_half",
        lambda q, k, v: ((q, k, v), {"q_segment_ids": jnp.zeros((2, 8), jnp.int32)}),
        "pass both q_segment_ids",
    ),
    (
        "varlen_batch",
        lambda q, k, v: ((q, k, v), {"cu_seqlens_q": jnp.array([0, 8]), "cu_seqlens_k": jnp.array([0, 8])}),
        "batch must be 1",
    ),
    ("unknown_option", lambda q, k, v: ((q, k, v), {"casual": True}), "casual"),
]


@pytest.mark.parametrize(("name", "make", "message"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_are_refused_with_a_clear_error(impl, name, make, message):
    q = jnp.ones((2, 8, 4, 16))
    k = v = jnp.ones((2, 8, 2, 16))
    args, kwargs = make(q, k, v)
    with pytest.raises((ValueError, TypeError), match=message):
        call(impl, *args, **kwargs)
