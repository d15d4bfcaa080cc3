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

from ejkernel.modules import MaskInfo, flash_attention
from ejkernel.modules.operations.flash_attention import _kernel
from ejkernel.testing import reference
from ejkernel.testing.conformance._attention import (
    FLASH_OPTION_BAD_INPUTS,
    QKV_BAD_INPUTS,
    BadInput,
    Case,
    assert_rows_without_keys_are_zero,
    bad_input_qkv,
    make_inputs,
)
from ejkernel.testing.conformance._harness import (
    DTYPES,
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
    forward_and_vjp,
    fresh_key,
    jitted,
    parametrize_implementations,
)
from ejkernel.testing.conformance._harness import skip_if_unsupported as _skip_if_unsupported

OP = "flash_attention"


pytest_generate_tests = parametrize_implementations(OP)

# ``Case(name, b, t, s, h, k, d, dv, options, arrays)``; ``arrays`` names the extra inputs ``_attention.make_inputs``
# builds: ``bias_full``, ``bias_heads`` (broadcast over the batch), ``attention_mask`` (a row masked whole),
# ``segment_ids`` (a query in a segment without keys), ``cu_seqlens`` (three packed sequences, one empty).
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
    Case("kv_lengths", b=3, arrays=("kv_lengths",)),
    Case(
        "prefix_lm_lengths_bias",
        t=41,
        s=41,
        arrays=("prefix_lengths", "kv_lengths", "bias_heads"),
        options=(("causal", True), ("sliding_window", (24, 0))),
    ),
]
# Every case in float32; a lower precision on the cases named here, each dtype on several paths (compiling is what
# costs time on CI; the GPU tier runs bfloat16 at realistic shapes).
DTYPE_CASES = dtype_cases(
    CASES,
    {
        "gqa_causal": ("bfloat16",),
        "segment_ids": ("bfloat16",),
        "varlen_causal": ("bfloat16",),
        "dropout": ("bfloat16",),
        "plain": ("float16",),
        "bias_full": ("float16",),
        "soft_cap": ("float16",),
        "prefix_lm_lengths_bias": ("float16", "bfloat16"),
    },
)
assert {p.values[1] for p in DTYPE_CASES} == set(DTYPES)
# The GPU tier's realistic shapes: head dim 128, GQA, lengths of many blocks of any tile and a multiple of none.
GPU_CASES = [
    Case("gpu_gqa_causal", t=1031, s=1031, h=8, k=2, d=128, options=(("causal", True),)),
    Case("gpu_gqa_t_lt_s", t=1031, s=2053, h=8, k=2, d=128),
    Case(
        "gpu_window_soft_cap",
        t=1031,
        s=1031,
        h=8,
        k=2,
        d=128,
        options=(("sliding_window", (256, 0)), ("causal", True), ("logits_soft_cap", 30.0)),
    ),
    Case("gpu_segments", t=1031, s=1031, h=8, k=2, d=128, arrays=("segment_ids",), options=(("causal", True),)),
    Case("gpu_varlen", b=1, t=2053, s=2053, h=8, k=2, d=128, arrays=("cu_seqlens",), options=(("causal", True),)),
    Case("gpu_bias_mqa", t=1031, s=1031, h=8, k=1, d=128, arrays=("bias_heads",)),
    Case("gpu_decode", b=16, t=1, s=4099, h=32, k=8, d=128),
    Case(
        "gpu_prefix_lm_lengths",
        b=3,
        t=1031,
        s=1031,
        h=8,
        k=2,
        d=128,
        arrays=("prefix_lengths", "kv_lengths"),
        options=(("causal", True),),
    ),
]
GPU_DTYPE_CASES = [pytest.param(c, d, id=f"{c.name}-{d}") for c in GPU_CASES for d in ("bfloat16", "float32")]


def call(impl: Any, *args: Any, **kwargs: Any) -> Any:
    return call_forced(flash_attention, impl, *args, **kwargs)


def skip_if_unsupported(impl: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    _skip_if_unsupported(impl, _kernel, flash_attention, args, kwargs)


def _float_args(args: tuple[Any, ...]) -> tuple[int, ...]:
    return tuple(range(len(args)))  # q, k, v and bias are all differentiable


@pytest.mark.parametrize(("case", "dtype"), DTYPE_CASES)
def test_forward_matches_reference(impl, case, dtype):
    key, seed = fresh_key()
    args, kwargs = make_inputs(case, dtype, key)
    skip_if_unsupported(impl, args, kwargs)
    out = jitted(lambda *a, **kw: call(impl, *a, **kw), **kwargs)(*args)
    want = jitted(reference.flash_attention, **kwargs)(*args)
    assert out.dtype == jnp.dtype(dtype), f"output dtype {out.dtype} != input dtype {dtype}"
    assert_close(out, want, FWD_RTOL[dtype], f"{case.name} forward", seed)


@pytest.mark.parametrize(("case", "dtype"), DTYPE_CASES)
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
    assert_grads_close(("dq", "dk", "dv", "dbias"), got, want, GRAD_RTOL[dtype], case.name, seed)


@pytest.mark.parametrize(("case", "dtype"), GPU_DTYPE_CASES)
def test_gpu_tier_forward_and_gradients_match_reference(impl, case, dtype, gpu_tier):
    key, seed = fresh_key()
    args, kwargs = make_inputs(case, dtype, key)
    skip_if_unsupported(impl, args, kwargs)
    cot = jax.random.normal(jax.random.fold_in(key, 1), (case.b, case.t, case.h, case.dv or case.d))
    out, grads = forward_and_vjp(lambda *a, **kw: call(impl, *a, **kw), args, kwargs, cot)
    want, want_grads = forward_and_vjp(reference.flash_attention, args, kwargs, cot)
    assert out.dtype == jnp.dtype(dtype), f"output dtype {out.dtype} != input dtype {dtype}"
    assert_close(out, want, FWD_RTOL[dtype], f"{case.name} forward", seed)
    assert_grads_close(("dq", "dk", "dv", "dbias"), grads, want_grads, GRAD_RTOL[dtype], case.name, seed)


def test_every_candidate_config_matches_reference(impl, tier):
    """Each launch configuration the implementation offers the autotuner: lengths of several tiles of each."""
    case = Case("candidates", t=80, s=97, options=(("causal", True), ("sliding_window", (40, 0))))
    key, seed = fresh_key()
    args, kwargs = make_inputs(case, "float32", key)
    skip_if_unsupported(impl, args, kwargs)
    cot = jax.random.normal(jax.random.fold_in(key, 1), (case.b, case.t, case.h, case.d))

    def check(cfg, want):
        out, grads = forward_and_vjp(lambda *a, **kw: call(impl, *a, cfg=cfg, **kw), args, kwargs, cot)
        assert_close(out, want[0], FWD_RTOL["float32"], "forward", seed)
        assert_grads_close(("dq", "dk", "dv"), grads, want[1], GRAD_RTOL["float32"], "gradients", seed)

    expected = lambda: forward_and_vjp(reference.flash_attention, args, kwargs, cot)  # noqa: E731
    check_candidate_configs(impl, _kernel, args, kwargs, check, tier=tier, expected=expected)


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
    check_grads_numerically(lambda *a: call(impl, *a, **kwargs), args)


def test_fully_masked_rows_give_zeros_and_zero_gradients(impl):
    key, seed = fresh_key()
    case = Case("masked", b=1, t=9, s=11, h=2, k=2, d=16)
    args, _ = make_inputs(case, "float32", key)
    mask = jnp.ones((1, 1, 9, 11), bool).at[:, :, 2].set(False).at[:, :, 5].set(False)
    skip_if_unsupported(impl, args, {"attention_mask": mask})
    out, vjp = jax.vjp(lambda q, k, v: call(impl, q, k, v, attention_mask=mask), *args)
    assert_rows_without_keys_are_zero(out, vjp(jnp.ones_like(out)), np.s_[:, [2, 5]], seed, what="fully masked rows")


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
    args, _ = make_inputs(Case("t", b=2, t=19, s=23, h=2, k=1, d=16), "float32", key)
    skip_if_unsupported(impl, args, {"causal": True})
    assert_jit_and_vmap_agree_with_eager(lambda *a: call(impl, *a, causal=True), args, seed)


def test_mask_info_is_its_dense_mask(impl):
    """A ``MaskInfo`` (lengths, prefix-LM, window, segments) gives what its dense mask gives, also under
    ``jit`` (the mask an argument) and ``vmap`` (over stacked batches, the lengths mapped too)."""
    key, seed = fresh_key()
    case = Case("mask_info", b=3, t=29, s=29, h=2, k=1, d=16, arrays=("kv_lengths", "prefix_lengths", "segment_ids"))
    args, kw = make_inputs(case, "float32", key)
    mask = (
        MaskInfo.from_lengths(kw["kv_lengths"])
        & MaskInfo.prefix_lm(kw["prefix_lengths"])
        & MaskInfo.window((12, 3))
        & MaskInfo.from_segment_ids(kw["q_segment_ids"], kw["kv_segment_ids"])
    )
    skip_if_unsupported(impl, args, mask.flash_attention_arguments())
    want = reference.flash_attention(*args, attention_mask=mask.to_dense(case.t, case.s))
    got = jax.jit(lambda m, *a: call(impl, *a, attention_mask=m))(mask, *args)
    assert_close(got, want, FWD_RTOL["float32"], "MaskInfo forward", seed)
    stacked = jax.tree.map(lambda x: jnp.stack([x, x[::-1]]), (args, mask))
    got = jax.vmap(lambda a, m: call(impl, *a, attention_mask=m))(*stacked)
    flipped = MaskInfo(
        **{
            **mask.flash_attention_arguments(),
            **{n: x[::-1] for n, x in mask.flash_attention_arguments().items() if isinstance(x, jax.Array)},
        }
    )
    want_flipped = reference.flash_attention(*(a[::-1] for a in args), attention_mask=flipped.to_dense(case.t, case.s))
    assert_close(got[0], want, FWD_RTOL["float32"], "MaskInfo under vmap", seed)
    assert_close(got[1], want_flipped, FWD_RTOL["float32"], "MaskInfo under vmap (second element)", seed)


# (id, make(q, k, v) -> (args, kwargs), what the message says): the checks of q/k/v every attention op makes,
# those of the options flash_attention shares with attention, and its own.
BAD_INPUTS: list[BadInput] = [
    *QKV_BAD_INPUTS,
    *FLASH_OPTION_BAD_INPUTS,
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
    (
        "kv_lengths_shape",
        lambda q, k, v: ((q, k, v), {"kv_lengths": jnp.array([8, 8, 8])}),
        r"kv_lengths must be a 1-D integer array \[B\] = \[2\]",
    ),
    ("kv_lengths_range", lambda q, k, v: ((q, k, v), {"kv_lengths": jnp.array([8, 9])}), r"kv_lengths\[1\] = 9"),
    (
        "prefix_not_causal",
        lambda q, k, v: ((q, k, v), {"prefix_lengths": jnp.array([2, 3])}),
        "prefix_lengths needs causal=True",
    ),
    (
        "mask_info_twice",
        lambda q, k, v: (
            (q, k, v),
            {"attention_mask": MaskInfo.prefix_lm(jnp.array([1, 2])), "prefix_lengths": jnp.array([1, 2])},
        ),
        "prefix_lengths is given both directly and by attention_mask",
    ),
]


@pytest.mark.parametrize(("name", "make", "message"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_are_refused_with_a_clear_error(impl, name, make, message):
    args, kwargs = make(*bad_input_qkv())
    assert_refused(lambda *a, **kw: call(impl, *a, **kw), args, kwargs, message, OP)
