"""Conformance suite of ``attention``: every installed implementation against the reference.

Layout: B batch, T query length, S key length, H query heads, K kv heads, D head dim, Dv value dim.
Weights: ``[B, H, T, S]`` float32, the matrix that multiplies the values (after dropout).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.modules import attention
from ejkernel.modules.operations.attention import _kernel
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

OP = "attention"
# The weights are float32 whatever the inputs, but computed from half-precision scores: their error is
# that of the forward pass in the input dtype.
WEIGHTS_RTOL = FWD_RTOL


pytest_generate_tests = parametrize_implementations(OP)

# Cases (shapes, options, extra arrays) and their inputs are those of flash_attention (``_attention.make_inputs``).
CASES = [
    Case("plain"),
    Case("gqa_causal", options=(("causal", True),)),  # bottom-right aligned, as flash_attention
    Case("causal_t_gt_s", t=53, s=37, options=(("causal", True),)),  # the first rows see no key
    Case("mqa_dv_differs", k=1, dv=48),
    Case("window_asymmetric", options=(("sliding_window", (3, 9)),)),
    Case("soft_cap", options=(("logits_soft_cap", 2.0), ("softmax_scale", 0.7))),
    Case("bias_full", arrays=("bias_full",)),
    Case("bias_broadcast_batch", arrays=("bias_heads",)),
    Case("attention_mask", arrays=("attention_mask",)),
    Case("dropout", options=(("dropout_prob", 0.25), ("dropout_seed", 1234))),
    Case("length_one_query", t=1, s=29, options=(("causal", True),)),
]
# Every case in float32; the half-precision dtypes on the cases that exercise a different path each.
DTYPE_CASES = dtype_cases(CASES, {"gqa_causal": ("bfloat16", "float16"), "bias_full": ("bfloat16", "float16")})
# The GPU tier's realistic shapes: head dim 128, GQA, lengths a multiple of no block size.
GPU_CASES = [
    Case("gpu_gqa_causal", t=1031, s=1031, h=8, k=2, d=128, options=(("causal", True),)),
    Case("gpu_window_soft_cap_t_lt_s", t=1031, s=2053, h=8, k=2, d=128,
         options=(("sliding_window", (256, 64)), ("logits_soft_cap", 30.0))),
    Case("gpu_mask_mqa", t=1031, s=1031, h=8, k=1, d=128, arrays=("attention_mask",)),
    Case("gpu_dropout", t=1031, s=1031, h=8, k=2, d=128, options=(("dropout_prob", 0.1), ("dropout_seed", 7))),
]  # fmt: skip
GPU_DTYPE_CASES = [pytest.param(c, d, id=f"{c.name}-{d}") for c in GPU_CASES for d in ("bfloat16", "float32")]


def call(impl: Any, *args: Any, **kwargs: Any) -> Any:
    return call_forced(attention, impl, *args, **kwargs)


def skip_if_unsupported(impl: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    _skip_if_unsupported(impl, _kernel, attention, args, kwargs)


def _results_and_grads(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], cots: tuple[jax.Array, ...]) -> Any:
    """``(out, weights)`` of ``fn`` and the gradients of ``sum(out * cot_out) + sum(weights * cot_weights)``
    in every float input, compiled as one."""

    def both(*a: Any, **kw: Any) -> Any:
        def loss(*x: Any) -> Any:
            out, weights = fn(*x, **kw, return_weights=True)
            value = jnp.sum(out.astype(jnp.float32) * cots[0]) + jnp.sum(weights.astype(jnp.float32) * cots[1])
            return value, (out, weights)

        grads, results = jax.grad(loss, argnums=tuple(range(len(a))), has_aux=True)(*a)
        return results, grads

    return jitted(both, **kwargs)(*args)


@pytest.mark.parametrize(("case", "dtype"), DTYPE_CASES)
def test_forward_weights_and_gradients_match_reference(impl, case, dtype):
    check_case(impl, case, dtype)


@pytest.mark.parametrize(("case", "dtype"), GPU_DTYPE_CASES)
def test_gpu_tier_forward_weights_and_gradients_match_reference(impl, case, dtype, gpu_tier):
    check_case(impl, case, dtype)


def check_case(impl: Any, case: Case, dtype: str) -> None:
    """The output, the weights and every gradient against the reference's."""
    key, seed = fresh_key()
    args, kwargs = make_inputs(case, dtype, key)
    skip_if_unsupported(impl, args, {**kwargs, "return_weights": True})
    kc, kw = jax.random.split(jax.random.fold_in(key, 1))
    cots = (
        jax.random.normal(kc, (case.b, case.t, case.h, case.dv or case.d)),
        jax.random.normal(kw, (case.b, case.h, case.t, case.s)),
    )
    (out, weights), grads = _results_and_grads(lambda *a, **kw: call(impl, *a, **kw), args, kwargs, cots)
    (want, want_weights), want_grads = _results_and_grads(reference.attention, args, kwargs, cots)
    assert out.dtype == jnp.dtype(dtype), f"output dtype {out.dtype} != input dtype {dtype}"
    assert weights.dtype == jnp.float32, f"weights dtype {weights.dtype} != float32"
    assert_close(out, want, FWD_RTOL[dtype], f"{case.name} forward", seed)
    assert_close(weights, want_weights, WEIGHTS_RTOL[dtype], f"{case.name} weights", seed)
    assert_grads_close(("dq", "dk", "dv", "dbias"), grads, want_grads, GRAD_RTOL[dtype], case.name, seed)


def test_every_candidate_config_matches_reference(impl, tier):
    """Each launch configuration the implementation offers the autotuner: lengths of several tiles of each."""
    case = Case("candidates", t=80, s=97, arrays=("bias_heads",), options=(("causal", True),))
    key, seed = fresh_key()
    args, kwargs = make_inputs(case, "float32", key)
    skip_if_unsupported(impl, args, {**kwargs, "return_weights": True})
    kc, kw = jax.random.split(jax.random.fold_in(key, 1))
    cots = (
        jax.random.normal(kc, (case.b, case.t, case.h, case.d)),
        jax.random.normal(kw, (case.b, case.h, case.t, case.s)),
    )

    def check(cfg, want):
        fn = lambda *a, **kw: call(impl, *a, cfg=cfg, **kw)  # noqa: E731
        (out, weights), grads = _results_and_grads(fn, args, kwargs, cots)
        (want_out, want_weights), want_grads = want
        assert_close(out, want_out, FWD_RTOL["float32"], "forward", seed)
        assert_close(weights, want_weights, WEIGHTS_RTOL["float32"], "weights", seed)
        assert_grads_close(("dq", "dk", "dv", "dbias"), grads, want_grads, GRAD_RTOL["float32"], "gradients", seed)

    expected = lambda: _results_and_grads(reference.attention, args, kwargs, cots)  # noqa: E731
    check_candidate_configs(
        impl, _kernel, args, {**kwargs, "return_weights": True}, check, tier=tier, expected=expected
    )


def test_weights_are_the_matrix_that_multiplies_the_values(impl):
    """Rows of the weights sum to 1 (0 when masked whole), ``out == weights @ v``, and without
    ``return_weights`` the output alone is returned, the same."""
    key, seed = fresh_key()
    case = Case("w", b=2, t=9, s=12, h=4, k=2, d=16, arrays=("attention_mask",), options=(("causal", True),))
    args, kwargs = make_inputs(case, "float32", key)
    skip_if_unsupported(impl, args, {**kwargs, "return_weights": True})
    out, weights = jitted(lambda *a, **kw: call(impl, *a, **kw, return_weights=True), **kwargs)(*args)
    alone = jitted(lambda *a, **kw: call(impl, *a, **kw), **kwargs)(*args)
    assert isinstance(alone, jax.Array), f"return_weights=False must return one array, got {type(alone)}"
    assert_close(alone, out, 1e-6, "output without weights", seed)
    sums = np.asarray(weights.sum(-1))
    allowed = np.asarray(reference.attention_allowed(case.t, case.s, causal=True)) & np.asarray(
        kwargs["attention_mask"]
    )
    masked_whole = ~allowed.any(-1)  # [B, 1, T]
    np.testing.assert_allclose(sums, np.where(masked_whole, 0.0, 1.0) * np.ones_like(sums), atol=1e-5)
    v = jnp.repeat(args[2], case.h // case.k, axis=2)
    by_hand = jnp.einsum("bhts,bshd->bthd", weights, v, precision="highest")
    assert_close(out, by_hand, 1e-5, "out against weights @ v", seed)


def test_agrees_with_flash_attention_entry_for_entry(impl):
    """The same options give the same output as ``flash_attention``'s reference, dropout included."""
    key, seed = fresh_key()
    case = Case(
        "f",
        b=2,
        t=13,
        s=17,
        arrays=("bias_heads",),
        options=(("causal", True), ("sliding_window", (6, 2)), ("dropout_prob", 0.3), ("dropout_seed", 99)),
    )
    args, kwargs = make_inputs(case, "float32", key)
    skip_if_unsupported(impl, args, kwargs)
    out = jitted(lambda *a, **kw: call(impl, *a, **kw), **kwargs)(*args)
    want = jitted(reference.flash_attention, **kwargs)(*args)
    assert_close(out, want, FWD_RTOL["float32"], "attention against flash_attention", seed)


def test_check_grads_numerically(impl):
    """Finite differences on a tiny call with bias, soft cap and a window, through the output and the weights."""
    case = Case(
        "tiny",
        b=1,
        t=7,
        s=9,
        h=2,
        k=1,
        d=8,
        arrays=("bias_full",),
        options=(("logits_soft_cap", 2.0), ("sliding_window", (3, 4))),
    )
    key, seed = fresh_key()
    args, kwargs = make_inputs(case, "float32", key)
    skip_if_unsupported(impl, args, {**kwargs, "return_weights": True})
    check_grads_numerically(jax.jit(lambda *a: call(impl, *a, **kwargs, return_weights=True)), args)


def test_fully_masked_rows_give_zeros_and_zero_gradients(impl):
    key, seed = fresh_key()
    case = Case("masked", b=1, t=9, s=11, h=2, k=2, d=16)
    args, _ = make_inputs(case, "float32", key)
    mask = jnp.ones((1, 1, 9, 11), bool).at[:, :, 2].set(False).at[:, :, 5].set(False)
    skip_if_unsupported(impl, args, {"attention_mask": mask, "return_weights": True})

    def results_and_grads(*a: Any) -> Any:
        res, vjp = jax.vjp(lambda q, k, v: call(impl, q, k, v, attention_mask=mask, return_weights=True), *a)
        return res, vjp(jax.tree.map(jnp.ones_like, res))

    (out, weights), grads = jax.jit(results_and_grads)(*args)
    assert_rows_without_keys_are_zero(out, grads, np.s_[:, [2, 5]], seed, what="fully masked rows")
    assert np.all(np.isfinite(weights)), f"NaN/inf in the weights (seed {seed})"
    assert np.all(np.asarray(weights[:, :, [2, 5]]) == 0), "fully masked rows have zero weights"


def test_dropout_is_deterministic_per_seed(impl):
    key, seed = fresh_key()
    args, _ = make_inputs(Case("d", b=1, t=16, s=16, h=2, k=2, d=16), "float32", key)
    kw = {"dropout_prob": 0.5, "return_weights": True}
    skip_if_unsupported(impl, args, {**kw, "dropout_seed": 1})
    _, a = call(impl, *args, **kw, dropout_seed=1)
    _, b = call(impl, *args, **kw, dropout_seed=1)
    _, c = call(impl, *args, **kw, dropout_seed=jnp.asarray(2, jnp.int32))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a) == 0, np.asarray(c) == 0), "a different seed must drop other entries"
    dropped = float(np.mean(np.asarray(a) == 0))
    assert 0.35 < dropped < 0.65, f"dropout_prob=0.5 dropped {dropped:.2f} of the weights (seed {seed})"


def test_jit_and_vmap_agree_with_eager(impl):
    key, seed = fresh_key()
    args, _ = make_inputs(Case("t", b=2, t=7, s=9, h=2, k=1, d=8), "float32", key)
    skip_if_unsupported(impl, args, {"causal": True})
    assert_jit_and_vmap_agree_with_eager(lambda *a: call(impl, *a, causal=True), args, seed)


# (id, make(q, k, v) -> (args, kwargs), what the message says): the checks of q/k/v every attention op makes,
# those of the options attention shares with flash_attention, and its own.
BAD_INPUTS: list[BadInput] = [
    *QKV_BAD_INPUTS,
    *FLASH_OPTION_BAD_INPUTS,
    ("return_weights", lambda q, k, v: ((q, k, v), {"return_weights": "yes"}), "return_weights must be a bool"),
    ("segments", lambda q, k, v: ((q, k, v), {"q_segment_ids": jnp.zeros((2, 8), jnp.int32)}), "q_segment_ids"),
]


@pytest.mark.parametrize(("name", "make", "message"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_are_refused_with_a_clear_error(impl, name, make, message):
    args, kwargs = make(*bad_input_qkv())
    assert_refused(lambda *a, **kw: call(impl, *a, **kw), args, kwargs, message, OP)
