"""Conformance suite of ``lightning_attn``: every installed implementation against the reference.

Layout: B batch, T length, H heads, K query/key head dim, V value head dim, N packed sequences.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from ejkernel.modules import lightning_attn
from ejkernel.modules.operations.lightning_attn import _kernel
from ejkernel.testing import reference
from ejkernel.testing.conformance._harness import (
    DTYPES,
    assert_close,
    call_forced,
    fresh_key,
    implementations_under_test,
)
from ejkernel.testing.conformance._harness import skip_if_unsupported as _skip_if_unsupported
from ejkernel.testing.conformance._linear_attention import Case, base_inputs, check_against_reference, outputs_and_grads

OP = "lightning_attn"


def pytest_generate_tests(metafunc: Any) -> None:
    if "impl" in metafunc.fixturenames:
        metafunc.parametrize("impl", implementations_under_test(metafunc.config, OP))


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
LOW_PRECISION_CASES = ("plain",)


def make_inputs(case: Case, dtype: str, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    rng = np.random.default_rng(seed)
    arrays = base_inputs(case, dtype, rng)
    arrays["slope"] = jnp.asarray(rng.uniform(case.gate_scale / 20, case.gate_scale, case.h).astype(np.float32))
    return arrays, {"output_final_state": case.final_state, **dict(case.options)}


def call(impl: Any, **kwargs: Any) -> Any:
    return call_forced(lightning_attn, impl, **kwargs)


def skip_if_unsupported(impl: Any, arrays: dict[str, Any], options: dict[str, Any]) -> None:
    _skip_if_unsupported(impl, _kernel, lightning_attn, (), {**arrays, **options})


ALL = [
    pytest.param(c, d, id=f"{c.name}-{d}")
    for d in DTYPES
    for c in CASES
    if d == "float32" or c.name in LOW_PRECISION_CASES
]


@pytest.mark.parametrize(("case", "dtype"), ALL)
def test_outputs_final_state_and_gradients_match_reference(impl, case, dtype):
    _, seed = fresh_key()
    arrays, options = make_inputs(case, dtype, seed)
    skip_if_unsupported(impl, arrays, options)
    got = outputs_and_grads(lambda **kw: call(impl, **kw), arrays, options, seed)
    want = outputs_and_grads(reference.lightning_attn, arrays, options, seed)
    check_against_reference(got, want, case, dtype, seed)
    if case.cu_seqlens is not None:  # tokens outside every sequence: exact zeros, zero gradients
        end = case.cu_seqlens[-1]
        assert np.all(np.asarray(got[0][:, end:]) == 0), "tokens after cu_seqlens[-1] must give zeros"
        assert np.all(np.asarray(got[2]["q"][:, end:]) == 0)


def test_check_grads_numerically(impl):
    # Short: one slope decays every step, so its finite difference carries factors up to T**3 in its error
    # terms (at T = 20 a float32 check with eps = 1e-2 failed now and then while the gradient was right).
    case = Case("small", b=1, t=8, h=2, dk=4, dv=3, gate_scale=0.5)
    _, seed = fresh_key()
    arrays, options = make_inputs(case, "float32", seed)
    skip_if_unsupported(impl, arrays, options)
    names = ("q", "k", "v", "slope", "initial_state")

    def fn(*xs: Any) -> Any:
        return call(impl, **dict(zip(names, xs)), output_final_state=True)

    with jax.enable_x64(False):
        check_grads(fn, tuple(arrays[n] for n in names), order=1, modes=("rev",), atol=3e-2, rtol=3e-2, eps=1e-2)


def test_jit_and_vmap_agree_with_eager(impl):
    case = Case("t", b=2, t=23, h=2, dk=8, dv=8)
    _, seed = fresh_key()
    arrays, _ = make_inputs(case, "float32", seed)
    skip_if_unsupported(impl, arrays, {"output_final_state": True})
    eager = call(impl, **arrays, output_final_state=True)
    jitted = jax.jit(lambda a: call(impl, **a, output_final_state=True))(arrays)
    vmapped = jax.vmap(lambda a: call(impl, **a, output_final_state=True))(jax.tree.map(lambda x: x[None], arrays))
    for got, name in ((jitted, "jit"), (jax.tree.map(lambda x: x[0], vmapped), "vmap")):
        assert_close(got[0], eager[0], 1e-5, f"{name} output", seed)
        assert_close(got[1], eager[1], 1e-5, f"{name} final state", seed)


def test_sequence_split_equals_carrying_the_state(impl):
    case = Case("split", b=2, t=30, h=2, dk=8, dv=8)
    _, seed = fresh_key()
    arrays, _ = make_inputs(case, "float32", seed)
    skip_if_unsupported(impl, arrays, {"output_final_state": True})
    whole, state = call(impl, **arrays, output_final_state=True)
    time_axis = ("q", "k", "v")
    first = {n: (x[:, :21] if n in time_axis else x) for n, x in arrays.items()}
    o1, s1 = call(impl, **first, output_final_state=True)
    rest = {**{n: arrays[n][:, 21:] for n in time_axis}, "slope": arrays["slope"], "initial_state": s1}
    o2, s2 = call(impl, **rest, output_final_state=True)
    assert_close(jnp.concatenate([o1, o2], axis=1), whole, 1e-5, "split output", seed)
    assert_close(s2, state, 1e-5, "split final state", seed)


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
    with pytest.raises((ValueError, TypeError), match=message) as e:
        call(impl, **make(arrays))
    if name != "unknown_option":
        assert str(e.value).startswith("lightning_attn: "), f"the message must start with the op's name: {e.value}"
