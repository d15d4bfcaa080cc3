"""Conformance suite of ``scaled_dot_product_attention``: every installed implementation against the reference,
and against ``jax.nn.dot_product_attention`` wherever the two contracts agree.

Layout (jax's letters): B batch, T query length, S key length, N query heads, K kv heads, H head dim, Hv value dim.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.modules import scaled_dot_product_attention
from ejkernel.modules.operations.scaled_dot_product_attention import _kernel
from ejkernel.testing import reference
from ejkernel.testing.conformance._attention import (
    QKV_BAD_INPUTS,
    BadInput,
    assert_rows_without_keys_are_zero,
    bad_input_qkv,
)
from ejkernel.testing.conformance._harness import (
    FWD_RTOL,
    GRAD_RTOL,
    assert_close,
    assert_grads_close,
    assert_jit_and_vmap_agree_with_eager,
    assert_refused,
    call_forced,
    check_candidate_configs,
    check_grads_numerically,
    dtype_cases,
    fresh_key,
    jitted,
    parametrize_implementations,
)
from ejkernel.testing.conformance._harness import skip_if_unsupported as _skip_if_unsupported

OP = "scaled_dot_product_attention"


pytest_generate_tests = parametrize_implementations(OP)


@dataclasses.dataclass(frozen=True)
class Case:
    """One call shape plus options; ``arrays`` names extra array inputs the case builds."""

    name: str
    b: int = 2
    t: int = 37  # deliberately not a multiple of any block size
    s: int = 53
    n: int = 4
    k: int = 2
    h: int = 32
    hv: int | None = None
    options: tuple[tuple[str, Any], ...] = ()
    arrays: tuple[str, ...] = ()


CASES = [
    Case("plain"),
    Case("causal_t_gt_s", t=53, s=37, options=(("is_causal", True),)),
    # T > S + left: the last queries see no key and give zeros. The bias broadcasts along T (one constant
    # along S would have a zero gradient: softmax ignores it).
    Case(
        "window_causal_t_gt_s_bias",
        t=53,
        s=37,
        arrays=("bias_heads_keys",),
        options=(("local_window_size", 5), ("is_causal", True)),
    ),
    Case("bias_full_mqa", k=1, arrays=("bias_full",)),
    Case("mask_keys_hv_differs", hv=48, arrays=("mask_keys",)),
    Case("mask_queries_scale", arrays=("mask_queries",), options=(("scale", 0.7),)),
    # Causal with T < S: top-left, so keys past T are never seen.
    Case("mask_full_causal", arrays=("mask_full",), options=(("is_causal", True),)),
    Case("seq_lengths", arrays=("seq_lengths",), options=(("local_window_size", (4, 2)),)),
    Case("length_one_query", t=1, s=29),  # decoding (top-left causal would leave it key 0 alone)
]
# Every case in float32; the half-precision dtypes on the cases that exercise a different path each.
DTYPE_CASES = dtype_cases(CASES, {"causal_t_gt_s": ("bfloat16", "float16"), "seq_lengths": ("bfloat16", "float16")})
# The GPU tier's realistic shapes: head dim 128, GQA, lengths a multiple of no block size.
GPU_CASES = [
    Case("gpu_gqa_causal", t=1031, s=1031, n=8, k=2, h=128, options=(("is_causal", True),)),
    Case("gpu_window_bias_t_lt_s", t=1031, s=2053, n=8, k=2, h=128, arrays=("bias_heads_keys",),
         options=(("local_window_size", (256, 64)),)),
    Case("gpu_seq_lengths_mqa", t=1031, s=1031, n=8, k=1, h=128, arrays=("seq_lengths",),
         options=(("is_causal", True),)),
    Case("gpu_mask_keys", t=1031, s=1031, n=8, k=2, h=128, arrays=("mask_keys",)),
]  # fmt: skip
GPU_DTYPE_CASES = [pytest.param(c, d, id=f"{c.name}-{d}") for c in GPU_CASES for d in ("bfloat16", "float32")]


def make_inputs(case: Case, dtype: str, key: jax.Array) -> tuple[tuple[Any, ...], dict[str, Any]]:
    kq, kk, kv, kb, km = jax.random.split(key, 5)
    b, t, s, n = case.b, case.t, case.s, case.n
    q = jax.random.normal(kq, (b, t, n, case.h), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (b, s, case.k, case.h), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (b, s, case.k, case.hv or case.h), jnp.float32).astype(dtype)
    kwargs: dict[str, Any] = dict(case.options)
    bias = mask = None
    for name in case.arrays:
        if name == "bias_full":
            bias = jax.random.normal(kb, (b, n, t, s), jnp.float32).astype(dtype)
        elif name == "bias_heads_keys":
            bias = jax.random.normal(kb, (1, n, 1, s), jnp.float32).astype(dtype)
        elif name == "mask_keys":  # key padding, per batch; batch 0 sees no key at all
            mask = jax.random.bernoulli(km, 0.6, (b, 1, 1, s)).at[0].set(False)
        elif name == "mask_queries":
            mask = jax.random.bernoulli(km, 0.6, (1, 1, t, 1)).at[0, 0, 0].set(True)
        elif name == "mask_full":
            mask = jax.random.bernoulli(km, 0.7, (b, n, t, s)).at[1, 2, 5].set(False)  # one fully masked row
        elif name == "seq_lengths":  # batch 1: 4 valid queries and no valid key
            kwargs["query_seq_lengths"] = jnp.array([t - 5, 4], jnp.int32)
            kwargs["key_value_seq_lengths"] = jnp.array([s - 9, 0], jnp.int32)
        elif name == "seq_lengths_nonempty":  # under top-left causal every valid query row has key 0
            kwargs["query_seq_lengths"] = jnp.array([t - 7, 3], jnp.int32)
            kwargs["key_value_seq_lengths"] = jnp.array([1, s - 3], jnp.int32)
    if mask is not None:
        args: tuple[Any, ...] = (q, k, v, bias, mask)
    else:
        args = (q, k, v) if bias is None else (q, k, v, bias)
    return args, kwargs


def call(impl: Any, *args: Any, **kwargs: Any) -> Any:
    return call_forced(scaled_dot_product_attention, impl, *args, **kwargs)


def skip_if_unsupported(impl: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    _skip_if_unsupported(impl, _kernel, scaled_dot_product_attention, args, kwargs)


def _float_argnums(args: tuple[Any, ...]) -> tuple[int, ...]:
    return tuple(i for i, x in enumerate(args) if x is not None and jnp.issubdtype(x.dtype, jnp.floating))


def _out_and_grads(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], cot: jax.Array) -> Any:
    """``fn``'s output and the gradients of ``sum(out * cot)`` in q, k, v (and bias), compiled as one."""
    argnums = _float_argnums(args)

    def both(*a: Any, **kw: Any) -> Any:
        def loss(*x: Any) -> Any:
            full = list(a)
            for i, xi in zip(argnums, x):
                full[i] = xi
            out = fn(*full, **kw)
            return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32)), out

        grads, out = jax.grad(loss, argnums=tuple(range(len(argnums))), has_aux=True)(*(a[i] for i in argnums))
        return out, grads

    return jitted(both, **kwargs)(*args)


@pytest.mark.parametrize(("case", "dtype"), DTYPE_CASES)
def test_forward_and_gradients_match_reference(impl, case, dtype):
    check_case(impl, case, dtype)


@pytest.mark.parametrize(("case", "dtype"), GPU_DTYPE_CASES)
def test_gpu_tier_forward_and_gradients_match_reference(impl, case, dtype, gpu_tier):
    check_case(impl, case, dtype)


def check_case(impl: Any, case: Case, dtype: str) -> None:
    """The output and every gradient against the reference's."""
    key, seed = fresh_key()
    args, kwargs = make_inputs(case, dtype, key)
    skip_if_unsupported(impl, args, kwargs)
    cot = jax.random.normal(jax.random.fold_in(key, 1), (case.b, case.t, case.n, case.hv or case.h)).astype(dtype)
    out, grads = _out_and_grads(lambda *a, **kw: call(impl, *a, **kw), args, kwargs, cot)
    want, want_grads = _out_and_grads(reference.scaled_dot_product_attention, args, kwargs, cot)
    assert out.dtype == jnp.dtype(dtype), f"output dtype {out.dtype} != input dtype {dtype}"
    assert_close(out, want, FWD_RTOL[dtype], f"{case.name} forward", seed)
    assert_grads_close(("dq", "dk", "dv", "dbias"), grads, want_grads, GRAD_RTOL[dtype], case.name, seed)


# Calls where every query row has a key: there jax.nn.dot_product_attention and the contract agree.
JAX_CASES = [
    Case("causal_t_lt_s", options=(("is_causal", True),)),
    Case("causal_t_gt_s_bias", t=53, s=37, arrays=("bias_heads_keys",), options=(("is_causal", True),)),
    Case("window_asymmetric_mqa", k=1, options=(("local_window_size", (3, 9)), ("scale", 0.7))),
    Case("seq_lengths_causal", arrays=("seq_lengths_nonempty",), options=(("is_causal", True),)),
]


@pytest.mark.parametrize("case", JAX_CASES, ids=lambda c: c.name)
def test_matches_jax_dot_product_attention(impl, case):
    key, seed = fresh_key()
    args, kwargs = make_inputs(case, "float32", key)
    skip_if_unsupported(impl, args, kwargs)
    out = jitted(lambda *a, **kw: call(impl, *a, **kw), **kwargs)(*args)
    want = jitted(lambda *a, **kw: jax.nn.dot_product_attention(*a, **kw, implementation="xla"), **kwargs)(*args)
    assert_close(out, want, FWD_RTOL["float32"], f"{case.name} against jax.nn.dot_product_attention", seed)


def test_every_candidate_config_matches_reference(impl, tier):
    """Each launch configuration the implementation offers the autotuner, on lengths of several tiles of each (block
    skipping and the band's edges exercised)."""
    case = Case("blocks", b=1, t=70, s=45, n=2, k=1, h=16, options=(("local_window_size", (9, 4)),))
    key, seed = fresh_key()
    args, kwargs = make_inputs(case, "float32", key)
    kwargs["key_value_seq_lengths"] = jnp.array([40], jnp.int32)
    skip_if_unsupported(impl, args, kwargs)
    cot = jax.random.normal(jax.random.fold_in(key, 1), (1, 70, 2, 16))

    def check(cfg, want):
        out, grads = _out_and_grads(lambda *a, **kw: call(impl, *a, **kw, cfg=cfg), args, kwargs, cot)
        assert_close(out, want[0], FWD_RTOL["float32"], "forward", seed)
        assert_grads_close(("dq", "dk", "dv"), grads, want[1], GRAD_RTOL["float32"], "gradients", seed)

    expected = lambda: _out_and_grads(reference.scaled_dot_product_attention, args, kwargs, cot)  # noqa: E731
    check_candidate_configs(impl, _kernel, args, kwargs, check, tier=tier, expected=expected)


def test_check_grads_numerically(impl):
    """Finite differences on a tiny call with a bias, T > S and a causal window (compiled once, evaluated many times)."""
    case = Case(
        "tiny",
        b=1,
        t=9,
        s=7,
        n=2,
        k=1,
        h=8,
        arrays=("bias_heads_keys",),
        options=(("local_window_size", (4, 1)), ("is_causal", True)),
    )
    key, seed = fresh_key()
    args, kwargs = make_inputs(case, "float32", key)
    skip_if_unsupported(impl, args, kwargs)
    check_grads_numerically(jax.jit(lambda *a: call(impl, *a, **kwargs)), args)


def test_rows_without_keys_give_zeros_where_jax_gives_the_mean(impl):
    key, seed = fresh_key()
    case = Case("empty_rows", b=2, t=9, s=6, n=2, k=2, h=16)
    args, _ = make_inputs(case, "float32", key)
    # Batch 0: query rows 2 and 5 masked whole; batch 1: no valid key at all. With the window
    # (left 1, causal), rows 7 and 8 of batch 0 see no key either (7 - 1 > S - 1).
    mask = jnp.ones((2, 1, 9, 6), bool).at[0, :, 2].set(False).at[0, :, 5].set(False)
    kwargs: dict[str, Any] = {
        "key_value_seq_lengths": jnp.array([6, 0], jnp.int32),
        "local_window_size": 1,
        "is_causal": True,
    }
    skip_if_unsupported(impl, (*args, None, mask), kwargs)

    def out_and_grads(*a: Any) -> Any:
        out, vjp = jax.vjp(lambda q, k, v: call(impl, q, k, v, None, mask, **kwargs), *a)
        return out, vjp(jnp.ones_like(out))

    out, grads = jax.jit(out_and_grads)(*args)
    empty = np.zeros((2, 9), bool)
    empty[0, [2, 5, 7, 8]] = True
    empty[1] = True
    assert_rows_without_keys_are_zero(out, grads, empty, seed)
    assert np.all(np.abs(np.asarray(out)[~empty]).max(axis=-1) > 0), f"rows with keys must not be zero (seed {seed})"
    # The documented difference: jax averages all values on such rows (jax changing this would make
    # the contract's note stale).
    q, k, v = args
    jax_out = jax.nn.dot_product_attention(q, k, v, None, mask, **kwargs, implementation="xla")
    mean_v = jnp.broadcast_to(args[2].mean(axis=1, keepdims=True), out.shape)
    np.testing.assert_allclose(np.asarray(jax_out)[0, 2], np.asarray(mean_v)[0, 2], atol=1e-5)


def test_jit_and_vmap_agree_with_eager(impl):
    key, seed = fresh_key()
    args, _ = make_inputs(Case("t", b=2, t=7, s=9, n=2, k=1, h=8), "float32", key)
    skip_if_unsupported(impl, args, {"is_causal": True})
    assert_jit_and_vmap_agree_with_eager(lambda *a: call(impl, *a, is_causal=True), args, seed)


# (id, make(q, k, v) -> (args, kwargs), what the message says): the checks of q/k/v every attention op makes,
# then this op's own.
BAD_INPUTS: list[BadInput] = [
    *QKV_BAD_INPUTS,
    ("value_length", lambda q, k, v: ((q, k, v[:, :5]), {}), r"value must be \[B, S, K, Hv\]"),
    ("bias_ndim", lambda q, k, v: ((q, k, v, jnp.zeros((8, 8))), {}), "bias must be 4-D, broadcastable"),
    ("bias_shape", lambda q, k, v: ((q, k, v, jnp.zeros((2, 3, 8, 8))), {}), "bias must be 4-D, broadcastable"),
    ("mask_dtype", lambda q, k, v: ((q, k, v, None, jnp.ones((1, 1, 8, 8))), {}), "mask must be bool"),
    ("mask_shape", lambda q, k, v: ((q, k, v, None, jnp.ones((1, 1, 8, 7), bool)), {}), "mask must be 4-D"),
    (
        "seq_lengths_shape",
        lambda q, k, v: ((q, k, v), {"query_seq_lengths": jnp.array([8, 8, 8], jnp.int32)}),
        r"query_seq_lengths must be an integer array of shape \[B\]",
    ),
    (
        "seq_lengths_dtype",
        lambda q, k, v: ((q, k, v), {"key_value_seq_lengths": jnp.array([8.0, 8.0])}),
        "key_value_seq_lengths must be an integer array",
    ),
    ("window", lambda q, k, v: ((q, k, v), {"local_window_size": (-1, 2)}), "local_window_size must be"),
    ("causal_type", lambda q, k, v: ((q, k, v), {"is_causal": 1}), "is_causal must be a bool"),
    ("scale_type", lambda q, k, v: ((q, k, v), {"scale": jnp.float32(0.5)}), "scale must be a Python float"),
    ("unknown_option", lambda q, k, v: ((q, k, v), {"causal": True}), "causal"),
]


@pytest.mark.parametrize(("name", "make", "message"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_are_refused_with_a_clear_error(impl, name, make, message):
    args, kwargs = make(*bad_input_qkv())
    assert_refused(lambda *a, **kw: call(impl, *a, **kw), args, kwargs, message, OP)
