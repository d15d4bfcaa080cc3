"""Conformance suite of ``recurrent``: every installed implementation against the reference.

Layout: B batch, T length, H heads, K query/key head dim, V value head dim, N packed sequences.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from ejkernel.modules import recurrent
from ejkernel.modules.operations.recurrent import _kernel
from ejkernel.testing import reference
from ejkernel.testing.conformance._harness import (
    DTYPES,
    assert_close,
    call_forced,
    fresh_key,
    implementations_under_test,
)
from ejkernel.testing.conformance._harness import skip_if_unsupported as _skip_if_unsupported
from ejkernel.testing.conformance._linear_attention import (
    Case,
    base_inputs,
    check_against_reference,
    log_gate,
    outputs_and_grads,
)

OP = "recurrent"
GATES = ("g", "g_k", "g_v")


def pytest_generate_tests(metafunc: Any) -> None:
    if "impl" in metafunc.fixturenames:
        metafunc.parametrize("impl", implementations_under_test(metafunc.config, OP))


def case(name: str, gates: tuple[str, ...] = GATES, **kw: Any) -> tuple[Case, tuple[str, ...]]:
    return Case(name, **kw), gates


# Gates are ``gate_scale * log_sigmoid(x)``; with all three the per-entry decay adds up (scales kept small).
CASES = [
    # T=150: three chunks for a chunked form (state passed between them), not a multiple of any chunk size
    case("all_gates", b=2, t=150, h=2, gate_scale=0.1),
    case("g_only_reverse", ("g",), options=(("reverse", True),)),
    case("g_k_only", ("g_k",)),
    # packed lengths 1, 16, 0 and 20, visited backwards; tokens 37..40 are in no sequence
    case("g_v_only_varlen_reverse", ("g_v",), b=1, t=41, cu_seqlens=(0, 1, 17, 17, 37), options=(("reverse", True),)),
    case(
        "no_gates_batch_one_no_state_scale", (), b=1, initial_state=False, final_state=False, options=(("scale", 0.3),)
    ),  # fmt: skip
    case("decode_one_token", t=1),
    # log gates down to -100 per step on every axis: the state forgets within a token, nothing overflows
    case("strong_gates_varlen", b=1, t=41, cu_seqlens=(0, 1, 17, 17, 37), gate_scale=30.0),
]
LOW_PRECISION_CASES = ("all_gates",)


def make_inputs(c: Case, gates: tuple[str, ...], dtype: str, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    rng = np.random.default_rng(seed)
    arrays = base_inputs(c, dtype, rng)
    shapes = {"g": (c.b, c.t, c.h), "g_k": (c.b, c.t, c.h, c.dk), "g_v": (c.b, c.t, c.h, c.dv)}
    for name in gates:
        arrays[name] = log_gate(rng, shapes[name], c.gate_scale)
    return arrays, {"output_final_state": c.final_state, **dict(c.options)}


def call(impl: Any, **kwargs: Any) -> Any:
    return call_forced(recurrent, impl, **kwargs)


def skip_if_unsupported(impl: Any, arrays: dict[str, Any], options: dict[str, Any]) -> None:
    _skip_if_unsupported(impl, _kernel, recurrent, (), {**arrays, **options})


ALL = [
    pytest.param(c, g, d, id=f"{c.name}-{d}")
    for d in DTYPES
    for c, g in CASES
    if d == "float32" or c.name in LOW_PRECISION_CASES
]


@pytest.mark.parametrize(("case", "gates", "dtype"), ALL)
def test_outputs_final_state_and_gradients_match_reference(impl, case, gates, dtype):
    _, seed = fresh_key()
    arrays, options = make_inputs(case, gates, dtype, seed)
    skip_if_unsupported(impl, arrays, options)
    got = outputs_and_grads(lambda **kw: call(impl, **kw), arrays, options, seed)
    want = outputs_and_grads(reference.recurrent, arrays, options, seed)
    check_against_reference(got, want, case, dtype, seed)
    if case.cu_seqlens is not None:  # tokens outside every sequence: exact zeros, zero gradients
        end = case.cu_seqlens[-1]
        assert np.all(np.asarray(got[0][:, end:]) == 0), "tokens after cu_seqlens[-1] must give zeros"
        assert np.all(np.asarray(got[2]["q"][:, end:]) == 0)


def test_check_grads_numerically(impl):
    # Every gate, reversed, with an initial and a final state (the forward direction is checked numerically
    # in the gla and lightning_attn suites).
    reverse = True
    c = Case("small", b=1, t=20, h=1, dk=4, dv=3, gate_scale=0.5)
    _, seed = fresh_key()
    arrays, _ = make_inputs(c, GATES, "float32", seed)
    skip_if_unsupported(impl, arrays, {"reverse": reverse})
    names = ("q", "k", "v", *GATES, "initial_state")

    def fn(*xs: Any) -> Any:
        return call(impl, **dict(zip(names, xs)), output_final_state=True, reverse=reverse)

    with jax.enable_x64(False):
        check_grads(fn, tuple(arrays[n] for n in names), order=1, modes=("rev",), atol=3e-2, rtol=3e-2, eps=1e-2)


def test_reverse_is_the_forward_recurrence_on_flipped_time(impl):
    c = Case("flip", b=2, t=29, h=2, dk=8, dv=8)
    _, seed = fresh_key()
    arrays, _ = make_inputs(c, GATES, "float32", seed)
    skip_if_unsupported(impl, arrays, {"reverse": True, "output_final_state": True})
    o, state = call(impl, **arrays, reverse=True, output_final_state=True)
    flipped = {n: (jnp.flip(x, 1) if n != "initial_state" else x) for n, x in arrays.items()}
    o_f, state_f = call(impl, **flipped, output_final_state=True)
    assert_close(o, jnp.flip(o_f, 1), 1e-5, "reverse output", seed)
    assert_close(state, state_f, 1e-5, "reverse final state", seed)


def test_jit_and_vmap_agree_with_eager(impl):
    c = Case("t", b=2, t=23, h=2, dk=8, dv=8)
    _, seed = fresh_key()
    arrays, _ = make_inputs(c, GATES, "float32", seed)
    skip_if_unsupported(impl, arrays, {"output_final_state": True})
    eager = call(impl, **arrays, output_final_state=True)
    jitted = jax.jit(lambda a: call(impl, **a, output_final_state=True))(arrays)
    vmapped = jax.vmap(lambda a: call(impl, **a, output_final_state=True))(jax.tree.map(lambda x: x[None], arrays))
    for got, name in ((jitted, "jit"), (jax.tree.map(lambda x: x[0], vmapped), "vmap")):
        assert_close(got[0], eager[0], 1e-5, f"{name} output", seed)
        assert_close(got[1], eager[1], 1e-5, f"{name} final state", seed)


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
    with pytest.raises((ValueError, TypeError), match=message) as e:
        call(impl, **make(arrays))
    if name != "unknown_option":
        assert str(e.value).startswith("recurrent: "), f"the message must start with the op's name: {e.value}"
