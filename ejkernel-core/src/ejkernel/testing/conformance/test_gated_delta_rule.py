"""Conformance suite of ``gated_delta_rule``: every installed implementation against the reference recurrence.

Layout: B batch, T length, H query/key heads, HV value heads (a multiple of H; ``v``, ``g``, ``beta`` and the
state have them), K query/key head dim, V value head dim, N packed sequences.

Inputs are in the ranges a Gated DeltaNet layer produces: unit-norm keys (or ``use_qk_l2norm``), a log decay
``g = log_sigmoid(x + 4)`` (about -0.02, so the state carries across many chunks and the inter-chunk path
matters) and ``beta = sigmoid(x)``; with bfloat16 activations the gates stay float32, as in a model. With those the recurrence is a contraction and the default tolerances
hold (float32: 2e-5 relative). Every dtype runs on the first three cases; the rest run in float32 only, to
keep the compile count (one forward-and-backward program per case, dtype and side) inside CI's time.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from ejkernel.modules import gated_delta_rule
from ejkernel.modules.operations.gated_delta_rule import _kernel
from ejkernel.testing import reference
from ejkernel.testing.conformance._harness import (
    DTYPES,
    FWD_RTOL,
    GRAD_RTOL,
    assert_close,
    call_forced,
    check_candidate_configs,
    first_served,
    fresh_key,
    implementations_under_test,
    jitted,
)
from ejkernel.testing.conformance._harness import skip_if_unsupported as _skip_if_unsupported

OP = "gated_delta_rule"


def pytest_generate_tests(metafunc: Any) -> None:
    if "impl" in metafunc.fixturenames:
        metafunc.parametrize("impl", implementations_under_test(metafunc.config, OP))


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    b: int = 2
    t: int = 37  # deliberately not a multiple of any chunk size
    h: int = 2
    k: int = 16
    v: int = 24
    cu_seqlens: tuple[int, ...] | None = None
    initial_state: bool = False
    options: tuple[tuple[str, Any], ...] = ()
    hv: int | None = None  # value heads (grouped: a multiple of h); None: h

    @property
    def heads_v(self) -> int:
        return self.h if self.hv is None else self.hv


CASES = [
    Case("state_in_and_out", initial_state=True, options=(("output_final_state", True),)),
    # lengths 1, 0, 16 and 21; the last 3 tokens are outside every sequence
    Case(
        "varlen_empty_and_length_one_l2norm",
        b=1,
        t=41,
        cu_seqlens=(0, 1, 1, 17, 38),
        initial_state=True,
        options=(("output_final_state", True), ("use_qk_l2norm", True), ("scale", 0.5)),
    ),
    Case("decode_one_token", t=1, initial_state=True, options=(("output_final_state", True),)),
    Case("batch_one_long_l2norm", b=1, t=150, options=(("use_qk_l2norm", True),)),  # several chunks
    # Grouped value heads (as in Qwen3-Next): 4 value heads with their own gates and states over 2 query/key heads
    Case("grouped_value_heads", hv=4, initial_state=True, options=(("output_final_state", True),)),
    Case(
        "grouped_value_heads_varlen_l2norm",
        b=1,
        t=41,
        hv=4,
        cu_seqlens=(0, 1, 1, 17, 38),
        initial_state=True,
        options=(("output_final_state", True), ("use_qk_l2norm", True)),
    ),
]
ALL_DTYPES = ("state_in_and_out", "varlen_empty_and_length_one_l2norm", "decode_one_token")
CASE_DTYPES = [
    pytest.param(c, d, id=f"{c.name}-{d}") for c in CASES for d in DTYPES if d == "float32" or c.name in ALL_DTYPES
]
# The GPU tier's realistic shapes: head dims 128, lengths of many chunks, a multiple of none; packed sequences of
# a few hundred to a thousand tokens, one empty, with tokens after the last.
GPU_CASES = [
    Case("gpu_long_state", t=1031, h=4, k=128, v=128, initial_state=True, options=(("output_final_state", True),)),
    Case(
        "gpu_varlen_l2norm",
        b=1,
        t=2053,
        h=4,
        k=128,
        v=128,
        cu_seqlens=(0, 1, 700, 700, 1709, 2040),
        initial_state=True,
        options=(("output_final_state", True), ("use_qk_l2norm", True)),
    ),
    # Key dims of 256 (the chunked kernels' own plans on a GPU: key tiles of 256 channels).
    Case(
        "gpu_wide_heads_l2norm",
        t=517,
        h=2,
        k=256,
        v=256,
        initial_state=True,
        options=(("output_final_state", True), ("use_qk_l2norm", True)),
    ),
    # Decode steps (the fused recurrent kernels' shapes): 64 two-token steps with grouped value heads, and packed
    # steps of 0 to 4 tokens.
    Case("gpu_decode", b=64, t=2, h=4, hv=8, k=128, v=128, initial_state=True, options=(("output_final_state", True),)),
    Case(
        "gpu_decode_packed_l2norm",
        b=1,
        t=18,
        h=4,
        k=128,
        v=128,
        cu_seqlens=(0, 1, 3, 3, 7, 8, 12, 13, 16),
        initial_state=True,
        options=(("output_final_state", True), ("use_qk_l2norm", True)),
    ),
]
GPU_DTYPE_CASES = [pytest.param(c, d, id=f"{c.name}-{d}") for c in GPU_CASES for d in ("bfloat16", "float32")]


def make_inputs(case: Case, dtype: str, key: jax.Array) -> tuple[tuple[Any, ...], dict[str, Any]]:
    kq, kk, kv, kg, kb, ks = jax.random.split(key, 6)
    q = jax.random.normal(kq, (case.b, case.t, case.h, case.k), jnp.float32)
    k = jax.random.normal(kk, (case.b, case.t, case.h, case.k), jnp.float32)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(kv, (case.b, case.t, case.heads_v, case.v), jnp.float32)
    g = jax.nn.log_sigmoid(jax.random.normal(kg, (case.b, case.t, case.heads_v)) + 4.0)
    beta = jax.nn.sigmoid(jax.random.normal(kb, (case.b, case.t, case.heads_v)))
    kwargs: dict[str, Any] = dict(case.options)
    n = case.b
    if case.cu_seqlens is not None:
        kwargs["cu_seqlens"] = jnp.array(case.cu_seqlens, jnp.int32)
        n = len(case.cu_seqlens) - 1
    if case.initial_state:
        kwargs["initial_state"] = 0.5 * jax.random.normal(ks, (n, case.heads_v, case.k, case.v), jnp.float32)
    # bfloat16 activations keep float32 gates (the usual mix); float16 runs with float16 gates
    gate_dtype = "float32" if dtype == "bfloat16" else dtype
    return (q.astype(dtype), k.astype(dtype), v.astype(dtype), g.astype(gate_dtype), beta.astype(gate_dtype)), kwargs


def call(impl: Any, *args: Any, **kwargs: Any) -> Any:
    return call_forced(gated_delta_rule, impl, *args, **kwargs)


def skip_if_unsupported(impl: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    _skip_if_unsupported(impl, _kernel, gated_delta_rule, args, kwargs)


def _fwd_bwd(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], cots: tuple[Any, Any]) -> Any:
    """``fn``'s ``(o, final_state)`` and the gradients of ``<o, cot_o> + <final_state, cot_s>`` in q, k, v, g,
    beta and initial_state (when given), in one compiled call."""
    state = kwargs.get("initial_state")

    def run(q, k, v, g, beta, state=None, **kw):
        def f(*x):
            return fn(*x[:5], initial_state=x[5] if state is not None else None, **kw)

        primals = (q, k, v, g, beta) + ((state,) if state is not None else ())
        (o, final), vjp = jax.vjp(f, *primals)
        cot = (cots[0].astype(o.dtype), None if final is None else cots[1])
        return o, final, vjp(cot)

    static = {k: v for k, v in kwargs.items() if k != "initial_state"}
    if state is None:
        return jitted(run, **static)(*args)
    return jitted(run, **static)(*args, state)


def _cotangents(case: Case, key: jax.Array) -> tuple[jax.Array, jax.Array]:
    n = case.b if case.cu_seqlens is None else len(case.cu_seqlens) - 1
    kc = jax.random.split(jax.random.fold_in(key, 1))
    return (
        jax.random.normal(kc[0], (case.b, case.t, case.heads_v, case.v)),
        jax.random.normal(kc[1], (n, case.heads_v, case.k, case.v)),
    )


def _assert_matches(got: Any, want: Any, case: Case, dtype: str, final_state: bool, seed: int) -> None:
    o, final, grads = got
    want_o, want_final, want_grads = want
    assert o.dtype == jnp.dtype(dtype), f"output dtype {o.dtype} != input dtype {dtype}"
    assert_close(o, want_o, FWD_RTOL[dtype], f"{case.name} output", seed)
    if final_state:
        assert final.dtype == jnp.float32, f"final state dtype {final.dtype} != float32"
        assert_close(final, want_final, FWD_RTOL[dtype], f"{case.name} final state", seed)
    else:
        assert final is None, "final_state must be None without output_final_state"
    for name, g, w in zip(("dq", "dk", "dv", "dg", "dbeta", "dinitial_state"), grads, want_grads):
        assert g.dtype == w.dtype, f"{name} dtype {g.dtype} != {w.dtype}"
        assert_close(g, w, GRAD_RTOL[dtype], f"{case.name} {name}", seed)


@pytest.mark.parametrize(("case", "dtype"), CASE_DTYPES)
def test_forward_and_gradients_match_reference(impl, case, dtype):
    check_case(impl, case, dtype)


@pytest.mark.parametrize(("case", "dtype"), GPU_DTYPE_CASES)
def test_gpu_tier_forward_and_gradients_match_reference(impl, case, dtype, gpu_tier):
    check_case(impl, case, dtype)


def check_case(impl: Any, case: Case, dtype: str) -> None:
    """The output, the final state and every gradient against the reference's."""
    key, seed = fresh_key()
    args, kwargs = make_inputs(case, dtype, key)
    skip_if_unsupported(impl, args, kwargs)
    cots = _cotangents(case, key)
    got = _fwd_bwd(lambda *a, **kw: call(impl, *a, **kw), args, kwargs, cots)
    want = _fwd_bwd(reference.gated_delta_rule, args, kwargs, cots)
    _assert_matches(got, want, case, dtype, bool(kwargs.get("output_final_state")), seed)


def test_every_candidate_config_matches_reference(impl, tier):
    """Each launch configuration the implementation offers the autotuner: a length of several chunks of each, or
    decode steps for the fused recurrent kernel, which declines that length."""
    long = Case("candidates", b=1, t=80, initial_state=True, options=(("output_final_state", True),))
    cases = (long, dataclasses.replace(long, name="decode_candidates", b=3, t=5))
    key, seed = fresh_key()
    made = ((c, *make_inputs(c, "float32", key)) for c in cases)  # lazily: only the cases tried
    case, args, kwargs = first_served(impl, _kernel, ((m, m[1], m[2]) for m in made))
    skip_if_unsupported(impl, args, kwargs)
    cots = _cotangents(case, key)

    def check(cfg, want):
        got = _fwd_bwd(lambda *a, **kw: call(impl, *a, cfg=cfg, **kw), args, kwargs, cots)
        _assert_matches(got, want, case, "float32", True, seed)

    expected = lambda: _fwd_bwd(reference.gated_delta_rule, args, kwargs, cots)  # noqa: E731
    check_candidate_configs(impl, _kernel, args, kwargs, check, tier=tier, expected=expected)


def test_check_grads_numerically(impl):
    key, seed = fresh_key()
    case = Case("small", b=1, t=6, h=1, k=3, v=2, cu_seqlens=(0, 2, 6), initial_state=True)
    args, kwargs = make_inputs(case, "float32", key)
    skip_if_unsupported(impl, args, kwargs)
    cu = kwargs["cu_seqlens"]

    def f(q, k, v, g, beta, state):
        return call(impl, q, k, v, g, beta, initial_state=state, cu_seqlens=cu, output_final_state=True)

    check_grads(jax.jit(f), (*args, kwargs["initial_state"]), order=1, modes=("rev",), atol=2e-2, rtol=2e-2, eps=1e-2)


def test_decoding_token_by_token_equals_the_whole_sequence(impl):
    # The decoding loop: feed each token with the previous call's final state as the initial state. (With
    # T = 12 the whole sequence may take another path than one token does: chunks against the recurrence.)
    key, seed = fresh_key()
    args, kwargs = make_inputs(Case("d", b=2, t=12, initial_state=True), "float32", key)
    skip_if_unsupported(impl, args, {**kwargs, "output_final_state": True})
    whole, whole_state = call(impl, *args, **kwargs, output_final_state=True)
    step = jax.jit(lambda *a: call(impl, *a[:5], initial_state=a[5], output_final_state=True))
    state, outs = kwargs["initial_state"], []
    for t in range(12):
        o, state = step(*(x[:, t : t + 1] for x in args), state)
        outs.append(o)
    assert_close(jnp.concatenate(outs, axis=1), whole, FWD_RTOL["float32"], "token by token", seed)
    assert_close(state, whole_state, FWD_RTOL["float32"], "final state token by token", seed)


def test_empty_sequence_keeps_its_initial_state_and_outside_tokens_give_zeros(impl):
    key, seed = fresh_key()
    case = Case("e", b=1, t=12, cu_seqlens=(0, 0, 5, 5, 9), initial_state=True)
    args, kwargs = make_inputs(case, "float32", key)
    skip_if_unsupported(impl, args, {**kwargs, "output_final_state": True})
    o, final = call(impl, *args, **kwargs, output_final_state=True)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(final)), f"NaN/inf (seed {seed})"
    state = np.asarray(kwargs["initial_state"])
    np.testing.assert_array_equal(np.asarray(final[0]), state[0], "empty sequence 0 must keep its initial state")
    np.testing.assert_array_equal(np.asarray(final[2]), state[2], "empty sequence 2 must keep its initial state")
    assert np.all(np.asarray(o[0, 9:]) == 0), "tokens outside every sequence must give zeros"


def test_jit_and_vmap_agree_with_eager(impl):
    key, seed = fresh_key()
    args, kwargs = make_inputs(Case("t", b=2, t=19, initial_state=True), "float32", key)
    skip_if_unsupported(impl, args, kwargs)

    def f(*a):
        return call(impl, *a[:5], initial_state=a[5])[0]

    full = (*args, kwargs["initial_state"])
    eager = f(*full)
    assert_close(jax.jit(f)(*full), eager, 1e-6, "jit", seed)
    vmapped = jax.vmap(f)(*(x[:, None] for x in full))[:, 0]
    assert_close(vmapped, eager, 1e-5, "vmap", seed)


BAD_INPUTS = [
    ("q_ndim", lambda q, k, v, g, b: ((q[0], k, v, g, b), {}), r"q must be 4-D \[B, T, H, K\]"),
    ("g_ndim", lambda q, k, v, g, b: ((q, k, v, g[..., None], b), {}), r"g must be 3-D \[B, T, HV\]"),
    ("dtype_mismatch", lambda q, k, v, g, b: ((q, k.astype(jnp.bfloat16), v, g, b), {}), "must share a dtype"),
    ("int_beta", lambda q, k, v, g, b: ((q, k, v, g, b.astype(jnp.int32)), {}), "beta must be float32"),
    ("k_shape", lambda q, k, v, g, b: ((q, k[..., :8], v, g, b), {}), "k must have the shape of q"),
    (
        "v_heads",
        lambda q, k, v, g, b: ((q, k, jnp.ones((2, 8, 3, 24)), g, b), {}),
        r"v must be \[B, T, HV, V\].*multiple of H = 2",
    ),
    ("beta_shape", lambda q, k, v, g, b: ((q, k, v, g, b[:, :4]), {}), r"beta must be \[B, T, HV\]"),
    (
        "gates_query_heads",
        lambda q, k, v, g, b: ((q, k, jnp.ones((2, 8, 4, 24)), jnp.ones((2, 8, 4)), b), {}),
        r"beta must be \[B, T, HV\] = \[2, 8, 4\], got \[2, 8, 2\]",
    ),
    ("empty_t", lambda q, k, v, g, b: ((q[:, :0], k[:, :0], v[:, :0], g[:, :0], b[:, :0]), {}), "T must be at least 1"),
    (
        "state_shape",
        lambda q, k, v, g, b: ((q, k, v, g, b), {"initial_state": jnp.zeros((2, 2, 16, 16))}),
        r"initial_state must be \[B, HV, K, V\] = \[2, 2, 16, 24\]",
    ),
    (
        "state_query_heads",
        lambda q, k, v, g, b: (
            (q, k, jnp.ones((2, 8, 4, 24)), jnp.ones((2, 8, 4)), jnp.ones((2, 8, 4))),
            {"initial_state": jnp.zeros((2, 2, 16, 24))},
        ),
        r"initial_state must be \[B, HV, K, V\] = \[2, 4, 16, 24\]",
    ),
    (
        "varlen_state_shape",
        lambda q, k, v, g, b: (
            (q[:1], k[:1], v[:1], g[:1], b[:1]),
            {"cu_seqlens": jnp.array([0, 3, 8]), "initial_state": jnp.zeros((1, 2, 16, 24))},
        ),
        r"initial_state must be \[N, HV, K, V\] = \[2, 2, 16, 24\]",
    ),
    ("varlen_batch", lambda q, k, v, g, b: ((q, k, v, g, b), {"cu_seqlens": jnp.array([0, 8])}), "batch must be 1"),
    (
        "cu_float",
        lambda q, k, v, g, b: ((q[:1], k[:1], v[:1], g[:1], b[:1]), {"cu_seqlens": jnp.array([0.0, 8.0])}),
        "cu_seqlens must be a 1-D integer",
    ),
    ("scale_type", lambda q, k, v, g, b: ((q, k, v, g, b), {"scale": "0.5"}), "scale must be a Python float"),
    ("flag_type", lambda q, k, v, g, b: ((q, k, v, g, b), {"use_qk_l2norm": 1}), "use_qk_l2norm must be a bool"),
    ("unknown_option", lambda q, k, v, g, b: ((q, k, v, g, b), {"use_l2norm": True}), "use_l2norm"),
]


@pytest.mark.parametrize(("name", "make", "message"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_are_refused_with_a_clear_error(impl, name, make, message):
    q = k = jnp.ones((2, 8, 2, 16))
    v = jnp.ones((2, 8, 2, 24))
    g = beta = jnp.ones((2, 8, 2))
    args, kwargs = make(q, k, v, g, beta)
    with pytest.raises((ValueError, TypeError), match=message):
        call(impl, *args, **kwargs)
