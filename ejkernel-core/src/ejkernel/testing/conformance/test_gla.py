"""Conformance suite of ``gla``: every installed implementation against the reference.

Layout: B batch, T length, H query/key heads, HV value heads (a multiple of H), K query/key head dim, V value
head dim, N packed sequences.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.modules import gla
from ejkernel.modules.operations.gla import _kernel
from ejkernel.testing import reference
from ejkernel.testing.conformance._harness import (
    assert_refused,
    call_forced,
    dtype_cases,
    fresh_key,
    parametrize_implementations,
)
from ejkernel.testing.conformance._harness import skip_if_unsupported as _skip_if_unsupported
from ejkernel.testing.conformance._linear_attention import (
    GPU_CASES,
    GPU_DECODE_CASES,
    Case,
    assert_jit_and_vmap_agree,
    assert_split_equals_carrying_the_state,
    base_inputs,
    candidate_inputs,
    check_against_reference,
    check_every_candidate_config,
    check_grads_in,
    log_gate,
    outputs_and_grads,
)

OP = "gla"


pytest_generate_tests = parametrize_implementations(OP)


CASES = [
    # T=150: three chunks for a chunked form (state passed between them), not a multiple of any chunk size
    Case("plain", b=2, t=150, h=2),
    # Packed lengths 1, 16, 0 (empty: its final state is its initial state) and 20; tokens 37..40 are in no
    # sequence and must give zeros.
    Case("varlen", b=1, t=41, cu_seqlens=(0, 1, 17, 17, 37)),
    Case(
        "batch_one_no_state_scale",
        b=1,
        initial_state=False,
        final_state=False,
        options=(("scale", 0.3),),
    ),
    Case("decode_one_token", t=1),
    # log gates down to -100 per step: the state forgets within a token or two, yet nothing overflows
    Case("strong_gates", b=1, t=40, gate_scale=30.0),
    # Grouped value heads: 4 value heads (own gates and states) over 2 query/key heads; dense, then packed.
    Case("grouped_value_heads", b=2, t=37, h=2, hv=4, dk=16, dv=24),
    Case("grouped_value_heads_varlen", b=1, t=41, h=2, hv=4, dk=16, dv=24, cu_seqlens=(0, 1, 17, 17, 37)),
]
# Every case in float32; these also in half precision (compiling is what costs time on CI; packed float16 inputs take
# the float32 cases' dots, so packing is checked in bfloat16 only: ~18 s of Triton's interpreter on CI).
ALL = dtype_cases(CASES, {"plain": ("bfloat16", "float16"), "varlen": ("bfloat16",)})
# The GPU tier's realistic shapes (``_linear_attention.GPU_CASES``).
GPU_DTYPE_CASES = [
    pytest.param(c, d, id=f"{c.name}-{d}") for c in GPU_CASES + GPU_DECODE_CASES for d in ("bfloat16", "float32")
]


def make_inputs(case: Case, dtype: str, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    rng = np.random.default_rng(seed)
    arrays = base_inputs(case, dtype, rng)
    arrays["g"] = log_gate(rng, (case.b, case.t, case.heads_v, case.dk), case.gate_scale)
    return arrays, {"output_final_state": case.final_state, **dict(case.options)}


def call(impl: Any, **kwargs: Any) -> Any:
    return call_forced(gla, impl, **kwargs)


def skip_if_unsupported(impl: Any, arrays: dict[str, Any], options: dict[str, Any]) -> None:
    _skip_if_unsupported(impl, _kernel, gla, (), {**arrays, **options})


@pytest.mark.parametrize(("case", "dtype"), ALL)
def test_outputs_final_state_and_gradients_match_reference(impl, case, dtype):
    check_case(impl, case, dtype)


@pytest.mark.parametrize(("case", "dtype"), GPU_DTYPE_CASES)
def test_gpu_tier_outputs_final_state_and_gradients_match_reference(impl, case, dtype, gpu_tier):
    check_case(impl, case, dtype)


def check_case(impl: Any, case: Case, dtype: str) -> None:
    """The output, the final state and every gradient against the reference's."""
    _, seed = fresh_key()
    arrays, options = make_inputs(case, dtype, seed)
    skip_if_unsupported(impl, arrays, options)
    got = outputs_and_grads(lambda **kw: call(impl, **kw), arrays, options, seed)
    want = outputs_and_grads(reference.gla, arrays, options, seed)
    check_against_reference(got, want, case, dtype, seed)


def test_every_candidate_config_matches_reference(impl, tier):
    """Each launch configuration the implementation offers the autotuner: a length of several chunks of each, or
    decode steps for the fused recurrent kernels, which decline that length."""
    _, seed = fresh_key()
    case, arrays, options = candidate_inputs(impl, _kernel, lambda c: make_inputs(c, "float32", seed))
    skip_if_unsupported(impl, arrays, options)
    check_every_candidate_config(impl, _kernel, gla, reference.gla, case, arrays, options, seed, tier)


def test_check_grads_numerically(impl):
    # T=20 is long enough for a chunked form, short enough for finite differences.
    case = Case("small", b=1, t=20, h=1, dk=4, dv=3, gate_scale=1.0)
    _, seed = fresh_key()
    arrays, options = make_inputs(case, "float32", seed)
    skip_if_unsupported(impl, arrays, options)
    check_grads_in(partial(call, impl, output_final_state=True), arrays, ("q", "k", "v", "g", "initial_state"))


def test_default_scale_is_one_over_sqrt_k(impl):
    case = Case("scale", b=1, t=19, h=2, dk=8, dv=8)
    _, seed = fresh_key()
    arrays, _ = make_inputs(case, "float32", seed)
    skip_if_unsupported(impl, arrays, {})
    default, _ = call(impl, **arrays)
    explicit, _ = call(impl, **arrays, scale=8**-0.5)
    np.testing.assert_allclose(np.asarray(default), np.asarray(explicit), rtol=1e-6, atol=1e-6)


def test_jit_and_vmap_agree_with_eager(impl):
    case = Case("t", b=2, t=23, h=2, dk=8, dv=8)
    _, seed = fresh_key()
    arrays, _ = make_inputs(case, "float32", seed)
    skip_if_unsupported(impl, arrays, {"output_final_state": True})
    assert_jit_and_vmap_agree(partial(call, impl, output_final_state=True), arrays, seed)


def test_sequence_split_equals_carrying_the_state(impl):
    case = Case("split", b=2, t=30, h=2, dk=8, dv=8)
    _, seed = fresh_key()
    arrays, _ = make_inputs(case, "float32", seed)
    skip_if_unsupported(impl, arrays, {"output_final_state": True})
    assert_split_equals_carrying_the_state(
        partial(call, impl, output_final_state=True), arrays, ("q", "k", "v", "g"), 21, seed
    )


BAD_INPUTS = [
    ("q_ndim", lambda a: {**a, "q": a["q"][0]}, r"q must be 4-D \[B, T, H, K\]"),
    ("int_q", lambda a: {**a, "q": a["q"].astype(jnp.int32)}, "q must be float32, bfloat16 or float16"),
    ("dtype_mismatch", lambda a: {**a, "k": a["k"].astype(jnp.bfloat16)}, "q, k and v must share a dtype"),
    ("k_shape", lambda a: {**a, "k": a["k"][:, :, :, :4]}, "k must have the shape of q"),
    ("v_heads", lambda a: {**a, "v": jnp.ones((2, 8, 3, 5))}, r"v must be \[B, T, HV, V\].*multiple of H = 2"),
    ("g_shape", lambda a: {**a, "g": a["g"][..., :4]}, r"g must be \[B, T, HV, K\]"),
    (
        "g_query_heads",
        lambda a: {**a, "v": jnp.ones((2, 8, 4, 5))},
        r"g must be \[B, T, HV, K\] = \[2, 8, 4, 8\], got \[2, 8, 2, 8\]",
    ),
    ("g_dtype", lambda a: {**a, "g": a["g"].astype(jnp.int32)}, "g must be float32, bfloat16 or float16"),
    (
        "state_shape",
        lambda a: {**a, "initial_state": jnp.zeros((2, 2, 8, 4))},
        r"initial_state must be \[B, HV, K, V\]",
    ),
    (
        "state_query_heads",
        lambda a: {
            **a,
            "v": jnp.ones((2, 8, 4, 5)),
            "g": jnp.zeros((2, 8, 4, 8)),
            "initial_state": jnp.zeros((2, 2, 8, 5)),
        },
        r"initial_state must be \[B, HV, K, V\] = \[2, 4, 8, 5\]",
    ),
    (
        "varlen_batch",
        lambda a: {**a, "cu_seqlens": jnp.array([0, 8], jnp.int32)},
        "batch must be 1",
    ),
    ("varlen_dtype", lambda a: {**a, "cu_seqlens": jnp.array([0.0, 8.0])}, "cu_seqlens must be a 1-D integer"),
    ("scale_type", lambda a: {**a, "scale": "0.5"}, "scale must be a Python float"),
    ("final_flag", lambda a: {**a, "output_final_state": 1}, "output_final_state must be a bool"),
    ("unknown_option", lambda a: {**a, "reverse": True}, "reverse"),
]


@pytest.mark.parametrize(("name", "make", "message"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_are_refused_with_a_clear_error(impl, name, make, message):
    arrays = {
        "q": jnp.ones((2, 8, 2, 8)),
        "k": jnp.ones((2, 8, 2, 8)),
        "v": jnp.ones((2, 8, 2, 5)),
        "g": jnp.zeros((2, 8, 2, 8)),
    }
    assert_refused(partial(call, impl), (), make(arrays), message, OP)


def test_varlen_state_shape_uses_sequences(impl):
    # With cu_seqlens the initial state has one entry per sequence (N), not per batch row.
    case = Case("varlen", b=1, t=12, cu_seqlens=(0, 5, 12))
    _, seed = fresh_key()
    arrays, _ = make_inputs(case, "float32", seed)
    arrays["initial_state"] = arrays["initial_state"][:1]
    with pytest.raises(ValueError, match=r"gla: initial_state must be \[N, HV, K, V\]"):
        call(impl, **arrays)
