"""Conformance suite of ``block_sparse_attention``: every installed implementation against the reference.

Layout: B batch, T query length, S key length, H query heads, K kv heads, D head dim, Dv value dim.
Lengths are not multiples of the mask blocks, and long enough (about 100 tokens of 8-token blocks)
that an implementation computing on tiles of several blocks has several tiles, partial ones included.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.modules import block_sparse_attention
from ejkernel.modules.operations.block_sparse_attention import _kernel, block_sparse_mask
from ejkernel.testing import reference
from ejkernel.testing.conformance._attention import (
    QKV_BAD_INPUTS,
    BadInput,
    assert_rows_without_keys_are_zero,
    bad_input_qkv,
    qkv,
)
from ejkernel.testing.conformance._harness import (
    DTYPES,
    FWD_RTOL,
    GRAD_RTOL,
    assert_close,
    assert_grads_close,
    assert_refused,
    call_forced,
    check_candidate_configs,
    check_grads_numerically,
    dtype_cases,
    forward_and_vjp,
    fresh_key,
    parametrize_implementations,
)
from ejkernel.testing.conformance._harness import skip_if_unsupported as _skip_if_unsupported

OP = "block_sparse_attention"


pytest_generate_tests = parametrize_implementations(OP)


@dataclasses.dataclass(frozen=True)
class Case:
    """One call shape plus options; ``mask`` is the broadcast shape ``(B|1, H|1)`` of a random block mask."""

    name: str
    b: int = 2
    t: int = 99
    s: int = 117
    h: int = 4
    k: int = 2
    d: int = 32
    dv: int | None = None
    q_block: int = 8
    kv_block: int = 8
    mask: str | None = None  # "shared", "batch", "heads", "both"
    segments: bool = False
    options: tuple[tuple[str, Any], ...] = ()


CASES = [
    Case("dense"),
    Case("causal_t_gt_s", t=117, s=99, options=(("causal", True),)),
    Case("mask_shared_soft_cap_scale", mask="shared", options=(("logits_soft_cap", 2.0), ("softmax_scale", 0.3))),
    Case("mask_per_batch_segments_causal", mask="batch", segments=True, options=(("causal", True),)),
    Case("mask_per_head_gqa_unequal_blocks", q_block=5, kv_block=7, dv=48, mask="heads", options=(("causal", True),)),
    Case(
        "local_global_causal",
        q_block=16,
        kv_block=16,
        options=(("local_blocks", (2, 0)), ("global_blocks", 1), ("causal", True)),
    ),
    Case("length_one_query_mqa", t=1, s=29, k=1, mask="both", options=(("causal", True),)),
    Case("batch_one_mha_local", b=1, t=40, s=40, h=3, k=3, d=64, options=(("local_blocks", 1), ("causal", True))),
]
# Each case runs in float32; these also run in a lower precision (compiling is what costs time on CI).
DTYPE_CASES = dtype_cases(
    CASES, {"mask_per_head_gqa_unequal_blocks": ("bfloat16",), "local_global_causal": ("float16",)}
)
assert {p.values[1] for p in DTYPE_CASES} == set(DTYPES)
# The GPU tier's realistic shapes: head dim 128, GQA, lengths of many mask blocks, a multiple of none.
GPU_CASES = [
    Case("gpu_mask_heads_causal", t=1031, s=1031, h=8, k=2, d=128, q_block=64, kv_block=64, mask="heads",
         options=(("causal", True),)),
    Case("gpu_local_global_segments", t=1031, s=1031, h=8, k=2, d=128, q_block=64, kv_block=64, segments=True,
         options=(("local_blocks", (4, 0)), ("global_blocks", 1), ("causal", True))),
    Case("gpu_mask_both_t_lt_s_mqa", t=1031, s=2053, h=8, k=1, d=128, q_block=128, kv_block=64, mask="both"),
]  # fmt: skip
GPU_DTYPE_CASES = [pytest.param(c, d, id=f"{c.name}-{d}") for c in GPU_CASES for d in ("bfloat16", "float32")]


def make_inputs(case: Case, dtype: str, key: jax.Array) -> tuple[tuple[Any, ...], dict[str, Any]]:
    kq, kk, kv, km, ks1, ks2 = jax.random.split(key, 6)
    q, k, v = qkv(case, dtype, (kq, kk, kv))
    kwargs: dict[str, Any] = {"q_block": case.q_block, "kv_block": case.kv_block, **dict(case.options)}
    if case.mask is not None:
        lb = case.b if case.mask in ("batch", "both") else 1
        lh = case.h if case.mask in ("heads", "both") else 1
        nq, nk = -(-case.t // case.q_block), -(-case.s // case.kv_block)
        mask = jax.random.bernoulli(km, 0.4, (lb, lh, nq, nk))
        kwargs["block_mask"] = mask.at[0, 0, nq // 2].set(False)  # one query block sees nothing
    if case.segments:
        qs = jnp.sort(jax.random.randint(ks1, (case.b, case.t), 0, 3), axis=-1)
        kvs = jnp.sort(jax.random.randint(ks2, (case.b, case.s), 0, 3), axis=-1)
        kwargs["q_segment_ids"], kwargs["kv_segment_ids"] = qs.at[:, -1].set(7), kvs  # segment 7: no keys
    return (q, k, v), kwargs


def call(impl: Any, *args: Any, **kwargs: Any) -> Any:
    return call_forced(block_sparse_attention, impl, *args, **kwargs)


def skip_if_unsupported(impl: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    _skip_if_unsupported(impl, _kernel, block_sparse_attention, args, kwargs)


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
    cot = jax.random.normal(jax.random.fold_in(key, 1), (case.b, case.t, case.h, case.dv or case.d)).astype(dtype)
    out, grads = forward_and_vjp(lambda *a, **kw: call(impl, *a, **kw), args, kwargs, cot)
    want, want_grads = forward_and_vjp(reference.block_sparse_attention, args, kwargs, cot)
    assert out.dtype == jnp.dtype(dtype), f"output dtype {out.dtype} != input dtype {dtype}"
    assert_close(out, want, FWD_RTOL[dtype], f"{case.name} forward", seed)
    assert_grads_close(("dq", "dk", "dv"), grads, want_grads, GRAD_RTOL[dtype], case.name, seed)


def test_every_candidate_config_matches_reference(impl, tier):
    """Each launch configuration the implementation offers the autotuner (tiles of several mask blocks, partial
    ones included) computes the same thing."""
    case = Case("candidates_mqa", t=61, s=75, k=1, mask="both", options=(("causal", True),))
    key, seed = fresh_key()
    args, kwargs = make_inputs(case, "float32", key)
    skip_if_unsupported(impl, args, kwargs)
    cot = jax.random.normal(jax.random.fold_in(key, 1), (case.b, case.t, case.h, case.d))

    def check(cfg, want):
        out, grads = forward_and_vjp(lambda *a, **kw: call(impl, *a, cfg=cfg, **kw), args, kwargs, cot)
        assert_close(out, want[0], FWD_RTOL["float32"], "forward", seed)
        assert_grads_close(("dq", "dk", "dv"), grads, want[1], GRAD_RTOL["float32"], "gradients", seed)

    expected = lambda: forward_and_vjp(reference.block_sparse_attention, args, kwargs, cot)  # noqa: E731
    check_candidate_configs(impl, _kernel, args, kwargs, check, tier=tier, expected=expected)


def test_check_grads_numerically(impl):
    case = Case("tiny", b=1, t=11, s=13, h=2, k=1, d=8, q_block=3, kv_block=4, mask="heads")
    key, seed = fresh_key()
    args, kwargs = make_inputs(case, "float32", key)
    kwargs.update(causal=True, logits_soft_cap=3.0)
    skip_if_unsupported(impl, args, kwargs)
    check_grads_numerically(jax.jit(lambda *a: call(impl, *a, **kwargs)), args)


def test_fully_masked_rows_give_zeros_and_zero_gradients(impl):
    key, seed = fresh_key()
    case = Case("masked", b=1, t=20, s=24, h=2, k=1, d=16, q_block=4, kv_block=8)
    args, _ = make_inputs(case, "float32", key)
    mask = jnp.ones((1, 2, 5, 3), bool).at[:, :, 1].set(False)  # rows 4..7 of both heads see nothing
    qseg = jnp.zeros((1, 20), jnp.int32).at[:, 15].set(3)  # row 15: a segment without keys
    kw = {
        "block_mask": mask,
        "q_block": 4,
        "kv_block": 8,
        "q_segment_ids": qseg,
        "kv_segment_ids": jnp.zeros((1, 24), jnp.int32),
    }
    skip_if_unsupported(impl, args, kw)
    out, grads = forward_and_vjp(lambda *a, **k: call(impl, *a, **k), args, kw, jnp.ones((1, 20, 2, 16)))
    assert_rows_without_keys_are_zero(out, grads, np.s_[:, [4, 5, 6, 7, 15]], seed, what="fully masked rows")
    assert np.any(np.asarray(out[:, 8]) != 0), "the other rows must not be zero"


def test_pattern_equals_its_explicit_mask(impl):
    """``local_blocks``/``global_blocks``/``causal`` mean exactly the mask ``block_sparse_mask`` builds."""
    key, seed = fresh_key()
    case = Case("pattern", b=1, t=45, s=52, h=2, k=2, d=16, q_block=6, kv_block=5)
    args, _ = make_inputs(case, "float32", key)
    patterns: dict[str, Any] = {"local_blocks": (1, 2), "global_blocks": 2, "causal": True}
    common: dict[str, Any] = {"q_block": 6, "kv_block": 5}
    skip_if_unsupported(impl, args, {**common, **patterns})
    mask = jnp.asarray(block_sparse_mask(45, 52, **common, **patterns))[None, None]
    a = call(impl, *args, **common, **patterns)
    b = call(impl, *args, **common, block_mask=mask, causal=True)
    assert_close(a, b, 1e-6, "pattern vs its mask", seed)


def test_eager_and_vmap_agree(impl):
    key, seed = fresh_key()
    args, kwargs = make_inputs(Case("t", b=2, t=19, s=23, h=2, k=1, d=16), "float32", key)
    kwargs.update(causal=True, local_blocks=1, q_block=4, kv_block=4)
    skip_if_unsupported(impl, args, kwargs)
    eager = call(impl, *args, **kwargs)  # every other test runs under jit
    vmapped = jax.jit(jax.vmap(lambda *a: call(impl, *a, **kwargs)))(*(x[:, None] for x in args))[:, 0]
    assert_close(vmapped, eager, 1e-5, "vmap", seed)


def _mask(*shape: int, dtype: Any = bool) -> jax.Array:
    return jnp.ones(shape, dtype)


# (id, make(q, k, v) -> (args, kwargs), what the message says): the checks of q/k/v every attention op makes,
# then this op's own.
BAD_INPUTS: list[BadInput] = [
    *QKV_BAD_INPUTS,
    (
        "mask_shape",
        lambda q, k, v: ((q, k, v), {"block_mask": _mask(1, 1, 2, 3), "q_block": 4, "kv_block": 4}),
        r"block_mask must have shape \[B\|1, H\|1, ceil\(T/q_block\), ceil\(S/kv_block\)\] = \[2\|1, 4\|1, 2, 2\]",
    ),
    (
        "mask_heads",
        lambda q, k, v: ((q, k, v), {"block_mask": _mask(1, 2, 1, 1), "q_block": 8}),
        "block_mask must have shape",
    ),
    (
        "mask_dtype",
        lambda q, k, v: ((q, k, v), {"block_mask": _mask(1, 1, 1, 1, dtype=jnp.int32)}),
        "block_mask must be bool",
    ),
    (
        "mask_and_pattern",
        lambda q, k, v: ((q, k, v), {"block_mask": _mask(1, 1, 1, 1), "local_blocks": 1}),
        "pass block_mask or the patterns",
    ),
    ("q_block", lambda q, k, v: ((q, k, v), {"q_block": 0}), "q_block must be an int >= 1"),
    ("kv_block", lambda q, k, v: ((q, k, v), {"kv_block": 2.5}), "kv_block must be an int >= 1"),
    (
        "local_blocks",
        lambda q, k, v: ((q, k, v), {"local_blocks": (-1, 2)}),
        "local_blocks must be an int >= 0 or a pair",
    ),
    ("global_blocks", lambda q, k, v: ((q, k, v), {"global_blocks": -1}), "global_blocks must be an int >= 0"),
    ("soft_cap", lambda q, k, v: ((q, k, v), {"logits_soft_cap": 0.0}), "logits_soft_cap must be a positive"),
    ("causal", lambda q, k, v: ((q, k, v), {"causal": 1}), "causal must be a bool"),
    (
        "segments_half",
        lambda q, k, v: ((q, k, v), {"q_segment_ids": jnp.zeros((2, 8), jnp.int32)}),
        "pass both q_segment_ids",
    ),
    (
        "segments_shape",
        lambda q, k, v: (
            (q, k, v),
            {"q_segment_ids": jnp.zeros((2, 7), jnp.int32), "kv_segment_ids": jnp.zeros((2, 8), jnp.int32)},
        ),
        r"q_segment_ids must be an integer array of shape \[2, 8\]",
    ),
    ("unknown_option", lambda q, k, v: ((q, k, v), {"casual": True}), "casual"),
]


@pytest.mark.parametrize(("name", "make", "message"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_are_refused_with_a_clear_error(impl, name, make, message):
    args, kwargs = make(*bad_input_qkv())
    assert_refused(lambda *a, **kw: call(impl, *a, **kw), args, kwargs, message, OP)
