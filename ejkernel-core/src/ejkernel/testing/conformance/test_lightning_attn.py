"""Conformance suite of ``lightning_attn``: every installed implementation against the reference.

Layout: B batch, T length, H heads, K query/key head dim, V value head dim, N packed sequences.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.modules import lightning_attn
from ejkernel.modules.operations.lightning_attn import _kernel
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
    Case,
    assert_jit_and_vmap_agree,
    assert_split_equals_carrying_the_state,
    base_inputs,
    candidate_inputs,
    check_against_reference,
    check_every_candidate_config,
    check_grads_in,
    outputs_and_grads,
)

OP = "lightning_attn"


pytest_generate_tests = parametrize_implementations(OP)


# ``gate_scale`` is the range of the slopes here: uniform in [gate_scale / 20, gate_scale].
CASES = [
    # T=150: three chunks for a chunked form (state passed between them), not a multiple of any chunk size
    Case("plain", b=2, t=150, h=4, gate_scale=0.5),
    # Packed lengths 1, 16, 0 (empty: its final state is its initial state) and 20; tokens 37..40 are in no
    # sequence and must give zeros.
    Case("varlen", b=1, t=41, cu_seqlens=(0, 1, 17, 17, 37)),
    # slope 0 everywhere: plain causal linear attention (a running sum of k^T v)
    Case(
        "no_decay_batch_one_no_state_scale",
        b=1,
        initial_state=False,
        final_state=False,
        gate_scale=0.0,
        options=(("scale", 0.3),),
    ),  # fmt: skip
    Case("decode_one_token", t=1),
    # decays of exp(-8) per step: gone within a few tokens, yet nothing overflows
    Case("strong_decay", b=1, t=40, gate_scale=8.0),
]
# Every case in float32; this one also in half precision (compiling is what costs time on CI).
ALL = dtype_cases(CASES, {"plain": ("bfloat16", "float16")})
# The GPU tier's realistic shapes (``_linear_attention.GPU_CASES``).
GPU_DTYPE_CASES = [pytest.param(c, d, id=f"{c.name}-{d}") for c in GPU_CASES for d in ("bfloat16", "float32")]


def make_inputs(case: Case, dtype: str, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    rng = np.random.default_rng(seed)
    arrays = base_inputs(case, dtype, rng)
    arrays["slope"] = jnp.asarray(rng.uniform(case.gate_scale / 20, case.gate_scale, case.h).astype(np.float32))
    return arrays, {"output_final_state": case.final_state, **dict(case.options)}


def call(impl: Any, **kwargs: Any) -> Any:
    return call_forced(lightning_attn, impl, **kwargs)


def skip_if_unsupported(impl: Any, arrays: dict[str, Any], options: dict[str, Any]) -> None:
    _skip_if_unsupported(impl, _kernel, lightning_attn, (), {**arrays, **options})


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
    want = outputs_and_grads(reference.lightning_attn, arrays, options, seed)
    check_against_reference(got, want, case, dtype, seed)


def test_every_candidate_config_matches_reference(impl, tier):
    """Each launch configuration the implementation offers the autotuner: a length of several chunks of each, or
    decode steps for the fused recurrent kernels, which decline that length."""
    _, seed = fresh_key()
    case, arrays, options = candidate_inputs(impl, _kernel, lambda c: make_inputs(c, "float32", seed))
    skip_if_unsupported(impl, arrays, options)
    check_every_candidate_config(
        impl, _kernel, lightning_attn, reference.lightning_attn, case, arrays, options, seed, tier
    )


def test_check_grads_numerically(impl):
    # Short: one slope decays every step, so its finite difference carries factors up to T**3 in its error
    # terms (at T = 20 a float32 check with eps = 1e-2 failed now and then while the gradient was right).
    case = Case("small", b=1, t=8, h=2, dk=4, dv=3, gate_scale=0.5)
    _, seed = fresh_key()
    arrays, options = make_inputs(case, "float32", seed)
    skip_if_unsupported(impl, arrays, options)
    check_grads_in(partial(call, impl, output_final_state=True), arrays, ("q", "k", "v", "slope", "initial_state"))


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
    fn = partial(call, impl, output_final_state=True)
    assert_split_equals_carrying_the_state(fn, arrays, ("q", "k", "v"), 21, seed)  # the slope has no time axis


BAD_INPUTS = [
    ("q_ndim", lambda a: {**a, "q": a["q"][0]}, r"q must be 4-D \[B, T, H, K\]"),
    ("dtype_mismatch", lambda a: {**a, "v": a["v"].astype(jnp.float16)}, "q, k and v must share a dtype"),
    ("slope_shape", lambda a: {**a, "slope": jnp.zeros((2, 2))}, r"slope must be \[H\]"),
    ("slope_dtype", lambda a: {**a, "slope": jnp.zeros((2,), jnp.int32)}, "slope must be float32, bfloat16 or float16"),
    ("state_shape", lambda a: {**a, "initial_state": jnp.zeros((2, 2, 5, 8))}, r"initial_state must be \[B, H, K, V\]"),
    ("varlen_batch", lambda a: {**a, "cu_seqlens": jnp.array([0, 8], jnp.int32)}, "batch must be 1"),
    ("unknown_option", lambda a: {**a, "layer_idx": 3}, "layer_idx"),
]


@pytest.mark.parametrize(("name", "make", "message"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_are_refused_with_a_clear_error(impl, name, make, message):
    arrays = {
        "q": jnp.ones((2, 8, 2, 8)),
        "k": jnp.ones((2, 8, 2, 8)),
        "v": jnp.ones((2, 8, 2, 5)),
        "slope": jnp.ones(2),
    }
    assert_refused(partial(call, impl), (), make(arrays), message, OP)
