"""Conformance suite of ``recurrent``: every installed implementation against the reference.

Layout: B batch, T length, H heads, K query/key head dim, V value head dim, N packed sequences.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.modules import recurrent
from ejkernel.modules.operations.recurrent import _kernel
from ejkernel.testing import reference
from ejkernel.testing.conformance._harness import (
    assert_close,
    assert_refused,
    call_forced,
    dtype_cases,
    first_served,
    fresh_key,
    parametrize_implementations,
)
from ejkernel.testing.conformance._harness import skip_if_unsupported as _skip_if_unsupported
from ejkernel.testing.conformance._linear_attention import (
    CANDIDATE_CASES,
    GPU_CASES,
    Case,
    assert_jit_and_vmap_agree,
    assert_split_equals_carrying_the_state,
    base_inputs,
    check_against_reference,
    check_every_candidate_config,
    check_grads_in,
    log_gate,
    outputs_and_grads,
)

OP = "recurrent"
GATES = ("g", "g_k", "g_v")


pytest_generate_tests = parametrize_implementations(OP)


# Gates are ``gate_scale * log_sigmoid(x)``; with all three the per-entry decay adds up (scales kept small).
CASES = [
    # T=150: three chunks for a chunked form (state passed between them), not a multiple of any chunk size; one
    # sequence (batches elsewhere): in Triton's interpreter each of its three dtypes took ~40 s at b=2
    Case("all_gates", b=1, t=150, h=2, gates=GATES, gate_scale=0.1),
    Case("g_only_reverse", gates=("g",), options=(("reverse", True),)),
    Case("g_k_only", gates=("g_k",)),
    # packed lengths 1, 16, 0 and 20, visited backwards; tokens 37..40 are in no sequence
    Case(
        "g_v_only_varlen_reverse",
        b=1,
        t=41,
        cu_seqlens=(0, 1, 17, 17, 37),
        gates=("g_v",),
        options=(("reverse", True),),
    ),
    Case(
        "no_gates_batch_one_no_state_scale", b=1, initial_state=False, final_state=False, options=(("scale", 0.3),)
    ),  # fmt: skip
    Case("decode_one_token", t=1, gates=GATES),
    # log gates down to -100 per step on every axis: the state forgets within a token, nothing overflows
    Case("strong_gates_varlen", b=1, t=41, cu_seqlens=(0, 1, 17, 17, 37), gates=GATES, gate_scale=30.0),
    # strong scalar and value gates over two chunks of 64: the value gate's gradient sums terms that cancel
    Case("strong_value_gates", b=1, t=70, h=2, gates=("g", "g_v"), gate_scale=8.0),
    # every gate strong, packed (a sequence of 70 tokens: two chunks of 64) and visited backwards: both sides of the
    # state decay, and both gates' gradients sum terms that cancel
    Case(
        "strong_gates_varlen_reverse",
        b=1,
        t=100,
        h=2,
        cu_seqlens=(0, 3, 73, 73, 95),
        gates=GATES,
        gate_scale=8.0,
        options=(("reverse", True),),
    ),
]
# Every case in float32; every gate also in bfloat16, the key gate in float16 (compiling is what costs time on CI:
# float16 inputs take the float32 cases' dots in the chunked kernels, so a short case checks their loads and
# stores; all_gates in float16 took ~21 s of Triton's interpreter).
ALL = dtype_cases(CASES, {"all_gates": ("bfloat16",), "g_k_only": ("float16",)})
# The GPU tier's realistic shapes (``_linear_attention.GPU_CASES``) with every gate, the scalar gate alone and the
# scalar and key gates, the scalar and value gates (implementations may run each on other kernels; the key and value
# gates together are declined by some); the
# candidates' call with every gate.
ALL_GATES: dict[str, Any] = {"gates": GATES, "gate_scale": 0.1}
GPU_DTYPE_CASES = [
    pytest.param(dataclasses.replace(c, gates=gates, gate_scale=0.1), d, id=f"{c.name}-{'_'.join(gates)}-{d}")
    for c in GPU_CASES
    for gates in (GATES, ("g",), ("g", "g_k"), ("g", "g_v"))
    for d in ("bfloat16", "float32")
]


def make_inputs(c: Case, dtype: str, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    rng = np.random.default_rng(seed)
    arrays = base_inputs(c, dtype, rng)
    shapes = {"g": (c.b, c.t, c.h), "g_k": (c.b, c.t, c.h, c.dk), "g_v": (c.b, c.t, c.h, c.dv)}
    for name in c.gates:
        arrays[name] = log_gate(rng, shapes[name], c.gate_scale)
    return arrays, {"output_final_state": c.final_state, **dict(c.options)}


# The tests below that are not about one case take the first of these gate sets an implementation serves: every
# gate, else (kernels that decay one side of the state) the scalar gate with the key gate, or with the value gate.
GATE_SETS = (GATES, ("g", "g_k"), ("g", "g_v"), ("g",))


def served(impl: Any, cases: Case | tuple[Case, ...], options: dict[str, Any]) -> tuple[Case, dict[str, Any], int]:
    """``(the first of cases, with the first gate set of GATE_SETS, that impl serves; its float32 inputs; their
    seed)``; skipped (with the reason) when it serves none."""
    _, seed = fresh_key()
    cases = (cases,) if isinstance(cases, Case) else cases
    variants = (dataclasses.replace(case, gates=gates) for case in cases for gates in GATE_SETS)
    made = ((c, make_inputs(c, "float32", seed)[0]) for c in variants)  # lazily: only the variants tried
    case, arrays = first_served(impl, _kernel, ((m, (), {**m[1], **options}) for m in made))
    skip_if_unsupported(impl, arrays, options)
    return case, arrays, seed


def call(impl: Any, **kwargs: Any) -> Any:
    return call_forced(recurrent, impl, **kwargs)


def skip_if_unsupported(impl: Any, arrays: dict[str, Any], options: dict[str, Any]) -> None:
    _skip_if_unsupported(impl, _kernel, recurrent, (), {**arrays, **options})


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
    want = outputs_and_grads(reference.recurrent, arrays, options, seed)
    check_against_reference(got, want, case, dtype, seed)


def test_every_candidate_config_matches_reference(impl, tier):
    """Each launch configuration the implementation offers the autotuner: a length of several chunks of each, or
    decode steps for the fused recurrent kernels, which decline that length."""
    cases = tuple(dataclasses.replace(c, **ALL_GATES) for c in CANDIDATE_CASES)
    options = make_inputs(cases[0], "float32", 0)[1]
    case, arrays, seed = served(impl, cases, options)
    check_every_candidate_config(impl, _kernel, recurrent, reference.recurrent, case, arrays, options, seed, tier)


def test_check_grads_numerically(impl):
    # Every gate, reversed, with an initial and a final state (the forward direction is checked numerically
    # in the gla and lightning_attn suites).
    reverse = True
    c, arrays, _ = served(impl, Case("small", b=1, t=20, h=1, dk=4, dv=3, gate_scale=0.5), {"reverse": reverse})
    fn = partial(call, impl, output_final_state=True, reverse=reverse)
    check_grads_in(fn, arrays, ("q", "k", "v", *c.gates, "initial_state"))


def test_reverse_is_the_forward_recurrence_on_flipped_time(impl):
    _, arrays, seed = served(
        impl, Case("flip", b=2, t=29, h=2, dk=8, dv=8), {"reverse": True, "output_final_state": True}
    )
    o, state = call(impl, **arrays, reverse=True, output_final_state=True)
    flipped = {n: (jnp.flip(x, 1) if n != "initial_state" else x) for n, x in arrays.items()}
    o_f, state_f = call(impl, **flipped, output_final_state=True)
    assert_close(o, jnp.flip(o_f, 1), 1e-5, "reverse output", seed)
    assert_close(state, state_f, 1e-5, "reverse final state", seed)


def test_jit_and_vmap_agree_with_eager(impl):
    _, arrays, seed = served(impl, Case("t", b=2, t=23, h=2, dk=8, dv=8), {"output_final_state": True})
    assert_jit_and_vmap_agree(partial(call, impl, output_final_state=True), arrays, seed)


def test_sequence_split_equals_carrying_the_state(impl):
    c, arrays, seed = served(impl, Case("split", b=2, t=30, h=2, dk=8, dv=8), {"output_final_state": True})
    fn = partial(call, impl, output_final_state=True)
    assert_split_equals_carrying_the_state(fn, arrays, ("q", "k", "v", *c.gates), 21, seed)


BAD_INPUTS = [
    ("q_ndim", lambda a: {**a, "q": a["q"][0]}, r"q must be 4-D \[B, T, H, K\]"),
    ("dtype_mismatch", lambda a: {**a, "k": a["k"].astype(jnp.float16)}, "q, k and v must share a dtype"),
    ("g_shape", lambda a: {**a, "g": jnp.zeros((2, 8, 2, 1))}, r"g must be \[B, T, H\]"),
    ("g_k_shape", lambda a: {**a, "g_k": jnp.zeros((2, 8, 2, 5))}, r"g_k must be \[B, T, H, K\]"),
    ("g_v_shape", lambda a: {**a, "g_v": jnp.zeros((2, 8, 2, 8))}, r"g_v must be \[B, T, H, V\]"),
    ("g_v_dtype", lambda a: {**a, "g_v": jnp.zeros((2, 8, 2, 5), jnp.int32)}, "g_v must be float32, bfloat16"),
    ("reverse_type", lambda a: {**a, "reverse": "yes"}, "reverse must be a bool"),
    ("varlen_batch", lambda a: {**a, "cu_seqlens": jnp.array([0, 8], jnp.int32)}, "batch must be 1"),
    (
        "varlen_state",
        lambda a: {
            **a,
            "q": a["q"][:1],
            "k": a["k"][:1],
            "v": a["v"][:1],
            "cu_seqlens": jnp.array([0, 3, 8], jnp.int32),
            "initial_state": jnp.zeros((1, 2, 8, 5)),
        },
        r"initial_state must be \[N, H, K, V\]",
    ),  # fmt: skip
    ("unknown_option", lambda a: {**a, "g_gamma": jnp.zeros(2)}, "g_gamma"),
]


@pytest.mark.parametrize(("name", "make", "message"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_are_refused_with_a_clear_error(impl, name, make, message):
    arrays = {"q": jnp.ones((2, 8, 2, 8)), "k": jnp.ones((2, 8, 2, 8)), "v": jnp.ones((2, 8, 2, 5))}
    assert_refused(partial(call, impl), (), make(arrays), message, OP)
