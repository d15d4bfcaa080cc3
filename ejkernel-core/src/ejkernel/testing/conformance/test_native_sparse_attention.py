"""Conformance suite of ``native_sparse_attention``: every installed implementation against the reference.

Layout: B batch, T query length, S key length, H query heads, K kv heads, D head dim, N selection slots.
Key lengths are not multiples of ``block_size``; the random selections include ``-1`` pads, indices
past the last block, repeats and blocks wholly in a token's future (so some rows see nothing).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.modules import native_sparse_attention
from ejkernel.modules.operations.native_sparse_attention import _kernel
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

OP = "native_sparse_attention"
GATES = ("g_slc", "g_cmp", "g_swa")


pytest_generate_tests = parametrize_implementations(OP)


@dataclasses.dataclass(frozen=True)
class Case:
    """One call shape plus options; ``gates`` names the gates the case passes, ``counts`` how counts are given."""

    name: str
    b: int = 2
    t: int = 37
    s: int = 53
    h: int = 4
    k: int = 2
    d: int = 16
    dv: int | None = None
    n: int = 3
    block_size: int = 8
    gates: tuple[str, ...] = ()
    counts: str | None = None  # "int" or "array"
    options: tuple[tuple[str, Any], ...] = ()


CASES = [
    Case("selected_t_lt_s"),
    Case("selected_non_causal_count_int", counts="int", options=(("causal", False),)),
    Case("selected_t_gt_s_counts_array_gated", t=53, s=37, counts="array", gates=("g_slc",)),
    Case("all_branches", dv=24, gates=GATES, options=(("window_size", 7), ("softmax_scale", 0.3))),
    Case("all_branches_non_causal", gates=GATES, options=(("window_size", 5), ("causal", False))),
    Case("compressed_mqa", h=4, k=1, n=5, gates=("g_cmp",)),
    Case("length_one_query", t=1, s=29, gates=("g_cmp",)),
    Case(
        "batch_one_mha_window",
        b=1,
        t=40,
        s=40,
        h=2,
        k=2,
        d=32,
        block_size=16,
        gates=("g_swa",),
        options=(("window_size", 9),),
    ),
]
# Each case runs in float32; these also run in a lower precision (compiling is what costs time on CI).
DTYPE_CASES = dtype_cases(CASES, {"all_branches": ("bfloat16",), "compressed_mqa": ("float16",)})
assert {p.values[1] for p in DTYPE_CASES} == set(DTYPES)
# The GPU tier's realistic shapes: head dim 128, GQA, lengths of many blocks, a multiple of none.
GPU_CASES = [
    Case("gpu_all_branches", t=1031, s=1031, h=16, k=2, d=128, n=16, block_size=64, gates=GATES, counts="array",
         options=(("window_size", 128),)),
    Case("gpu_selected_t_lt_s", t=1031, s=2053, h=8, k=1, d=128, n=16, block_size=64),
]  # fmt: skip
GPU_DTYPE_CASES = [pytest.param(c, d, id=f"{c.name}-{d}") for c in GPU_CASES for d in ("bfloat16", "float32")]


def make_inputs(case: Case, dtype: str, key: jax.Array) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(q, k, v, *gates)`` (the differentiable inputs, in that order) and the rest as keywords."""
    kq, kk, kv, ki, kc, kg = jax.random.split(key, 6)
    q, k, v = qkv(case, dtype, (kq, kk, kv))
    n_blocks = -(-case.s // case.block_size)
    idx = jax.random.randint(ki, (case.b, case.t, case.k, case.n), -1, n_blocks + 1, jnp.int32)
    kwargs: dict[str, Any] = {"block_indices": idx, "block_size": case.block_size, **dict(case.options)}
    if case.counts == "int":
        kwargs["block_counts"] = case.n - 1
    elif case.counts == "array":
        kwargs["block_counts"] = jax.random.randint(kc, (case.b, case.t, case.k), 0, case.n + 1, jnp.int32)
    gates = tuple(
        jax.nn.sigmoid(jax.random.normal(g, (case.b, case.t, case.h), jnp.float32)).astype(dtype)
        for g in jax.random.split(kg, len(case.gates))
    )
    return (q, k, v, *gates), kwargs


def _fn(fn: Any, case_gates: tuple[str, ...]) -> Any:
    """``fn(q, k, v, *gates, **kwargs)`` with the gates passed by name (they are keyword-only)."""

    def call(q: Any, k: Any, v: Any, *gates: Any, block_indices: Any, **kwargs: Any) -> Any:
        return fn(q, k, v, block_indices, **dict(zip(case_gates, gates, strict=True)), **kwargs)

    return call


def call(impl: Any, *args: Any, **kwargs: Any) -> Any:
    return call_forced(native_sparse_attention, impl, *args, **kwargs)


def skip_if_unsupported(impl: Any, case_gates: tuple[str, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    q, k, v, *gates = args
    kw = {k_: v_ for k_, v_ in kwargs.items() if k_ != "block_indices"}
    _skip_if_unsupported(
        impl,
        _kernel,
        native_sparse_attention,
        (q, k, v, kwargs["block_indices"]),
        {**kw, **dict(zip(case_gates, gates, strict=True))},
    )


def _cot(case: Case, key: jax.Array, dtype: str) -> jax.Array:
    return jax.random.normal(jax.random.fold_in(key, 1), (case.b, case.t, case.h, case.dv or case.d)).astype(dtype)


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
    skip_if_unsupported(impl, case.gates, args, kwargs)
    cot = _cot(case, key, dtype)
    got, grads = forward_and_vjp(_fn(lambda *a, **kw: call(impl, *a, **kw), case.gates), args, kwargs, cot)
    want, want_grads = forward_and_vjp(_fn(reference.native_sparse_attention, case.gates), args, kwargs, cot)
    assert got.dtype == jnp.dtype(dtype), f"output dtype {got.dtype} != input dtype {dtype}"
    assert_close(got, want, FWD_RTOL[dtype], f"{case.name} forward", seed)
    names = ("dq", "dk", "dv", *(f"d{g}" for g in case.gates))
    assert_grads_close(names, grads, want_grads, GRAD_RTOL[dtype], case.name, seed)


def test_every_candidate_config_matches_reference(impl, tier):
    """Each launch configuration the implementation offers the autotuner computes the same thing."""
    case = Case("candidates", t=45, s=61, n=4, gates=GATES, counts="array", options=(("window_size", 6),))
    key, seed = fresh_key()
    args, kwargs = make_inputs(case, "float32", key)
    skip_if_unsupported(impl, case.gates, args, kwargs)
    q, k, v, *gates = args
    arguments = {**{k_: v_ for k_, v_ in kwargs.items() if k_ != "block_indices"}, **dict(zip(GATES, gates))}
    cot = _cot(case, key, "float32")
    names = ("dq", "dk", "dv", "dg_slc", "dg_cmp", "dg_swa")

    def check(cfg, want):
        fn = _fn(lambda *a, **kw: call(impl, *a, cfg=cfg, **kw), case.gates)
        got, grads = forward_and_vjp(fn, args, kwargs, cot)
        assert_close(got, want[0], FWD_RTOL["float32"], "forward", seed)
        assert_grads_close(names, grads, want[1], GRAD_RTOL["float32"], "gradients", seed)

    expected = lambda: forward_and_vjp(_fn(reference.native_sparse_attention, case.gates), args, kwargs, cot)  # noqa: E731
    call_args = (q, k, v, kwargs["block_indices"])
    check_candidate_configs(impl, _kernel, call_args, arguments, check, tier=tier, expected=expected)


def test_check_grads_numerically(impl):
    case = Case("tiny", b=1, t=9, s=11, h=2, k=1, d=8, n=2, block_size=4, gates=GATES, options=(("window_size", 3),))
    # (every branch, tiny: check_grads evaluates the function many times)
    key, seed = fresh_key()
    args, kwargs = make_inputs(case, "float32", key)
    skip_if_unsupported(impl, case.gates, args, kwargs)
    fn = jax.jit(lambda *a: _fn(lambda *x, **kw: call(impl, *x, **kw), case.gates)(*a, **kwargs))
    check_grads_numerically(fn, args)


def test_rows_without_keys_give_zeros_and_zero_gradients(impl):
    key, seed = fresh_key()
    case = Case("empty", b=1, t=12, s=12, h=2, k=1, d=8, n=2, block_size=4)
    args, kwargs = make_inputs(case, "float32", key)
    idx = jnp.zeros((1, 12, 1, 2), jnp.int32)  # block 0 (keys 0..3): rows 0..11 see it, causally
    idx = idx.at[0, 5].set(-1).at[0, 6].set(jnp.array([[3, 7]]))  # row 5: no slot; row 6: blocks past the end
    idx = idx.at[0, 1].set(2)  # row 1: only block 2 (keys 8..11), all in its future
    kwargs["block_indices"] = idx
    skip_if_unsupported(impl, (), args, kwargs)
    fn = _fn(lambda *a, **kw: call(impl, *a, **kw), ())
    out, grads = forward_and_vjp(fn, args, kwargs, jnp.ones((1, 12, 2, 8)))
    assert_rows_without_keys_are_zero(out, grads, np.s_[:, [1, 5, 6]], seed, what="rows without an admitted key")
    assert np.all(np.asarray(out[:, 4]) != 0), "row 4 sees block 0"


def test_selection_is_a_set_and_counts_cut_slots(impl):
    """Repeats, slot order, pads and out-of-range indices do not matter; ``block_counts=c`` uses the first c slots."""
    key, seed = fresh_key()
    case = Case("sets", b=1, t=24, s=30, h=2, k=2, d=8, n=3, block_size=4, gates=("g_slc",))
    args, kwargs = make_inputs(case, "float32", key)
    q, k, v, g = args
    idx = kwargs["block_indices"]
    skip_if_unsupported(impl, case.gates, args, {**kwargs, "block_counts": 2})

    def run(i: jax.Array, counts: int | None = None) -> Any:
        return jax.jit(lambda i: call(impl, q, k, v, i, g_slc=g, block_size=4, block_counts=counts))(i)

    base = run(idx)
    shuffled = jnp.concatenate(
        [idx[..., ::-1], idx[..., :1], jnp.full_like(idx[..., :1], 8), jnp.full_like(idx[..., :1], -3)], axis=-1
    )
    assert_close(run(shuffled), base, 1e-6, "reordered, repeated and padded selection", seed)
    assert_close(run(idx, 2), run(idx[..., :2]), 1e-6, "block_counts=2 vs the first two slots", seed)


def test_eager_and_vmap_agree(impl):
    key, seed = fresh_key()
    case = Case("t", b=2, t=13, s=17, h=2, k=1, d=8, n=2, block_size=4, gates=("g_cmp",))
    args, kwargs = make_inputs(case, "float32", key)
    skip_if_unsupported(impl, case.gates, args, kwargs)
    idx = kwargs["block_indices"]

    def fn(q: Any, k: Any, v: Any, g: Any, i: Any) -> Any:
        return call(impl, q, k, v, i, g_cmp=g, block_size=4)

    q, k, v, g = args
    eager = fn(q, k, v, g, idx)  # every other test runs under jit
    vmapped = jax.jit(jax.vmap(fn))(q[:, None], k[:, None], v[:, None], g[:, None], idx[:, None])[:, 0]
    assert_close(vmapped, eager, 1e-5, "vmap", seed)


def _gate(shape: tuple[int, ...] = (2, 8, 4), dtype: Any = jnp.float32) -> jax.Array:
    return jnp.ones(shape, dtype)


def _indices_after(make: Any) -> Any:
    """A ``QKV_BAD_INPUTS`` maker for this op, whose ``block_indices`` come after q, k, v."""

    def make_with_indices(q: Any, k: Any, v: Any, i: Any) -> Any:
        args, kwargs = make(q, k, v)
        return (*args, i), kwargs

    return make_with_indices


# (id, make(q, k, v, block_indices) -> (args, kwargs), what the message says): the checks of q/k/v every
# attention op makes, then this op's own.
BAD_INPUTS: list[BadInput] = [(name, _indices_after(make), message) for name, make, message in QKV_BAD_INPUTS] + [
    (
        "indices_shape",
        lambda q, k, v, i: ((q, k, v, i[:, :, :1]), {}),
        r"block_indices must be an integer array \[B, T, K, N\] = \[2, 8, 2, N >= 1\]",
    ),
    (
        "indices_dtype",
        lambda q, k, v, i: ((q, k, v, i.astype(jnp.float32)), {}),
        "block_indices must be an integer array",
    ),
    ("counts_negative", lambda q, k, v, i: ((q, k, v, i), {"block_counts": -1}), "block_counts must be an int >= 0"),
    (
        "counts_shape",
        lambda q, k, v, i: ((q, k, v, i), {"block_counts": jnp.ones((2, 8), jnp.int32)}),
        r"block_counts must be an int >= 0 or an integer array \[B, T, K\] = \[2, 8, 2\]",
    ),
    (
        "gate_shape",
        lambda q, k, v, i: ((q, k, v, i), {"g_slc": _gate((2, 8, 2))}),
        r"g_slc must have shape \[B, T, H\]",
    ),
    ("gate_dtype", lambda q, k, v, i: ((q, k, v, i), {"g_cmp": _gate(dtype=jnp.int32)}), "g_cmp must be float32"),
    ("block_size", lambda q, k, v, i: ((q, k, v, i), {"block_size": 0}), "block_size must be an int >= 1"),
    ("window_size", lambda q, k, v, i: ((q, k, v, i), {"window_size": -2}), "window_size must be an int >= 0"),
    ("window_without_gate", lambda q, k, v, i: ((q, k, v, i), {"window_size": 4}), "needs its gate g_swa"),
    ("gate_without_window", lambda q, k, v, i: ((q, k, v, i), {"g_swa": _gate()}), "needs window_size > 0"),
    ("causal", lambda q, k, v, i: ((q, k, v, i), {"causal": None}), "causal must be a bool"),
    ("unknown_option", lambda q, k, v, i: ((q, k, v, i), {"block_count": 2}), "block_count"),
]


@pytest.mark.parametrize(("name", "make", "message"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_are_refused_with_a_clear_error(impl, name, make, message):
    args, kwargs = make(*bad_input_qkv(), jnp.zeros((2, 8, 2, 2), jnp.int32))
    assert_refused(lambda *a, **kw: call(impl, *a, **kw), args, kwargs, message, OP)
