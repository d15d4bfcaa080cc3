"""Conformance suite of ``grouped_matmul``: every installed implementation against the reference and ``ragged_dot``.

Layout: M rows, K contraction dim, N output columns, G groups.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from ejkernel.modules import grouped_matmul
from ejkernel.modules.operations.grouped_matmul import _kernel
from ejkernel.testing import reference
from ejkernel.testing.conformance._harness import (
    DTYPES,
    FWD_RTOL,
    GRAD_RTOL,
    assert_close,
    call_forced,
    check_candidate_configs,
    dtype_cases,
    fresh_key,
    implementations_under_test,
    jitted,
)
from ejkernel.testing.conformance._harness import skip_if_unsupported as _skip_if_unsupported

OP = "grouped_matmul"


def pytest_generate_tests(metafunc: Any) -> None:
    if "impl" in metafunc.fixturenames:
        metafunc.parametrize("impl", implementations_under_test(metafunc.config, OP))


@dataclasses.dataclass(frozen=True)
class Case:
    """One call shape; ``covered`` is the fraction of the M rows that the groups cover (the rest give zeros)."""

    name: str
    m: int = 67  # deliberately not a multiple of any tile
    k: int = 24
    n: int = 40
    g: int = 5
    covered: float = 1.0
    empty_groups: int = 1
    options: tuple[tuple[str, Any], ...] = ()


CASES = [
    Case("uneven_groups_one_empty"),
    Case("groups_cover_part_of_m", covered=0.7, empty_groups=2),
    Case("transpose_rhs", options=(("transpose_rhs", True),)),
    Case("one_row_one_group", m=1, g=1, empty_groups=0),
    Case("preferred_float32", options=(("preferred_element_type", jnp.float32),)),
]
# Every case in float32; a lower precision on the cases named here (compiling is what costs time on CI; the GPU
# tier runs bfloat16 at realistic shapes).
DTYPE_CASES = dtype_cases(
    CASES,
    {"uneven_groups_one_empty": ("bfloat16",), "transpose_rhs": ("float16",), "groups_cover_part_of_m": ("bfloat16",)},
)
assert {p.values[1] for p in DTYPE_CASES} == set(DTYPES)
# The GPU tier's realistic shapes: an MoE layer's 4096 tokens over 8 experts, groups of random sizes, some empty.
GPU_CASES = [
    Case("gpu_imbalanced_two_empty", m=4096, k=1024, n=1024, g=8, empty_groups=2),
    Case("gpu_transpose_rhs_part_covered", m=4096, k=1024, n=1024, g=8, covered=0.8, options=(("transpose_rhs", True),)),
]  # fmt: skip
GPU_DTYPE_CASES = [pytest.param(c, d, id=f"{c.name}-{d}") for c in GPU_CASES for d in ("bfloat16", "float32")]


def random_group_sizes(key: jax.Array, m: int, g: int, covered: float, empty_groups: int) -> jax.Array:
    """``g`` sizes summing to ``round(covered * m)``, ``empty_groups`` of them zero (random ones), the rest random."""
    total = int(round(covered * m))
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel())
    full = rng.permutation(g)[: g - empty_groups]
    cuts = np.sort(rng.integers(0, total + 1, size=len(full) - 1)) if len(full) else np.zeros(0, int)
    sizes = np.zeros(g, np.int32)
    sizes[np.sort(full)] = np.diff(np.concatenate([[0], cuts, [total]]))
    return jnp.asarray(sizes)


def make_inputs(case: Case, dtype: str, key: jax.Array) -> tuple[tuple[Any, ...], dict[str, Any]]:
    kl, kr, kg = jax.random.split(key, 3)
    kwargs: dict[str, Any] = dict(case.options)
    rhs_shape = (case.g, case.n, case.k) if kwargs.get("transpose_rhs") else (case.g, case.k, case.n)
    lhs = jax.random.normal(kl, (case.m, case.k), jnp.float32).astype(dtype)
    rhs = jax.random.normal(kr, rhs_shape, jnp.float32).astype(dtype)
    sizes = random_group_sizes(kg, case.m, case.g, case.covered, case.empty_groups)
    return (lhs, rhs, sizes), kwargs


def call(impl: Any, *args: Any, **kwargs: Any) -> Any:
    return call_forced(grouped_matmul, impl, *args, **kwargs)


def skip_if_unsupported(impl: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    _skip_if_unsupported(impl, _kernel, grouped_matmul, args, kwargs)


def _fwd_bwd(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], cot: jax.Array) -> Any:
    """``fn``'s output and its gradients in lhs and rhs for the cotangent ``cot``, in one compiled call."""

    def run(lhs, rhs, sizes, **kw):
        out, vjp = jax.vjp(lambda a, b: fn(a, b, sizes, **kw), lhs, rhs)
        return (out, *vjp(cot.astype(out.dtype)))

    return jitted(run, **kwargs)(*args)


@pytest.mark.parametrize(("case", "dtype"), DTYPE_CASES)
def test_forward_and_gradients_match_reference(impl, case, dtype):
    check_case(impl, case, dtype)


@pytest.mark.parametrize(("case", "dtype"), GPU_DTYPE_CASES)
def test_gpu_tier_forward_and_gradients_match_reference(impl, case, dtype, gpu_tier):
    check_case(impl, case, dtype)


def check_case(impl: Any, case: Case, dtype: str, cfg: Any = None) -> None:
    """The output and both gradients against the reference's (with ``cfg``: that launch configuration)."""
    key, seed = fresh_key()
    args, kwargs = make_inputs(case, dtype, key)
    skip_if_unsupported(impl, args, kwargs)
    cot = jax.random.normal(jax.random.fold_in(key, 1), (case.m, case.n))
    got = _fwd_bwd(lambda *a, **kw: call(impl, *a, cfg=cfg, **kw), args, kwargs, cot)
    want = _fwd_bwd(reference.grouped_matmul, args, kwargs, cot)
    out_dtype = jnp.dtype(kwargs.get("preferred_element_type") or dtype)
    assert got[0].dtype == out_dtype, f"output dtype {got[0].dtype} != {out_dtype}"
    # the reference rounds its float32 result to the output dtype: compare at the output dtype's precision
    rtol = FWD_RTOL[out_dtype.name]
    assert_close(got[0], want[0], rtol, f"{case.name} forward (group sizes {args[2].tolist()})", seed)
    for name, g, w, x in zip(("dlhs", "drhs"), got[1:], want[1:], args[:2]):
        assert g.dtype == x.dtype, f"{name} dtype {g.dtype} != {x.dtype}"
        assert_close(g, w, GRAD_RTOL[dtype], f"{case.name} {name} (group sizes {args[2].tolist()})", seed)


def test_every_candidate_config_matches_reference(impl, tier):
    """Each launch configuration the implementation offers the autotuner: rows and columns of several tiles of each
    (a TPU kernel's are multiples of 128)."""
    case = Case("candidates", m=300, n=256)
    key, _ = fresh_key()
    args, kwargs = make_inputs(case, "float32", key)
    skip_if_unsupported(impl, args, kwargs)
    # Fresh inputs per candidate (the reference is cheap): group sizes vary too.
    check_candidate_configs(
        impl, _kernel, args, kwargs, lambda cfg, _: check_case(impl, case, "float32", cfg), tier=tier
    )


@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: c.name)
def test_matches_jax_ragged_dot(impl, case):
    key, seed = fresh_key()
    args, kwargs = make_inputs(case, "float32", key)
    skip_if_unsupported(impl, args, kwargs)
    cot = jax.random.normal(jax.random.fold_in(key, 1), (case.m, case.n))

    def ragged(lhs, rhs, sizes, *, transpose_rhs=False):
        return jax.lax.ragged_dot(lhs, jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs, sizes)

    got = _fwd_bwd(lambda *a, **kw: call(impl, *a, **kw), args, kwargs, cot)
    want = _fwd_bwd(ragged, args, kwargs, cot)
    for name, g, w in zip(("out", "dlhs", "drhs"), got, want):
        assert_close(g, w, GRAD_RTOL["float32"], f"{case.name} {name} vs ragged_dot", seed)


def test_check_grads_numerically(impl):
    key, seed = fresh_key()
    (lhs, rhs, sizes), _ = make_inputs(Case("small", m=9, k=3, n=4, g=3), "float32", key)
    skip_if_unsupported(impl, (lhs, rhs, sizes), {})
    check_grads(
        lambda a, b: call(impl, a, b, sizes), (lhs, rhs), order=1, modes=("rev",), atol=1e-2, rtol=1e-2, eps=1e-2
    )


def test_rows_outside_groups_and_empty_groups(impl):
    key, seed = fresh_key()
    lhs = jax.random.normal(key, (20, 8))
    rhs = jax.random.normal(jax.random.fold_in(key, 1), (4, 8, 6))
    sizes = jnp.array([0, 7, 0, 5], jnp.int32)  # rows 12..19 in no group; groups 0 and 2 empty
    skip_if_unsupported(impl, (lhs, rhs, sizes), {})
    out, vjp = jax.vjp(lambda a, b: call(impl, a, b, sizes), lhs, rhs)
    assert np.all(np.asarray(out[12:]) == 0), f"rows past sum(group_sizes) must be exactly zero (seed {seed})"
    np.testing.assert_allclose(np.asarray(out[:7]), np.asarray(lhs[:7] @ rhs[1]), rtol=1e-5, atol=1e-5)
    dlhs, drhs = vjp(jnp.ones_like(out))
    assert np.all(np.asarray(dlhs[12:]) == 0), "rows in no group must get a zero gradient"
    assert np.all(np.asarray(drhs[jnp.array([0, 2])]) == 0), "empty groups must get a zero gradient"
    # every row of lhs belongs to no group: all zeros
    zeros = call(impl, lhs, rhs, jnp.zeros((4,), jnp.int32))
    assert np.all(np.asarray(zeros) == 0)


def test_groups_past_m_are_cut_as_ragged_dot_does(impl):
    key, seed = fresh_key()
    lhs = jax.random.normal(key, (16, 8))
    rhs = jax.random.normal(jax.random.fold_in(key, 1), (3, 8, 5))
    sizes = jnp.array([10, 9, 4], jnp.int32)  # sum 23 > 16: group 1 is cut after 6 rows, group 2 has none
    skip_if_unsupported(impl, (lhs, rhs, sizes), {})
    got = call(impl, lhs, rhs, sizes)
    assert_close(got, jax.lax.ragged_dot(lhs, rhs, sizes), 1e-5, "cut groups vs ragged_dot", seed)


def test_jit_agrees_with_eager(impl):
    key, seed = fresh_key()
    (lhs, rhs, sizes), _ = make_inputs(Case("t", m=30, k=8, n=8, g=3), "float32", key)
    skip_if_unsupported(impl, (lhs, rhs, sizes), {})
    eager = call(impl, lhs, rhs, sizes)
    assert_close(jax.jit(lambda *a: call(impl, *a))(lhs, rhs, sizes), eager, 1e-6, "jit", seed)


BAD_INPUTS = [
    ("lhs_ndim", lambda l, r, s: ((l[None], r, s), {}), r"lhs must be 2-D \[M, K\]"),
    ("rhs_ndim", lambda l, r, s: ((l, r[0], s), {}), r"rhs must be 3-D \[G, K, N\]"),
    ("contraction", lambda l, r, s: ((l[:, :4], r, s), {}), r"rhs must be \[G, K, N\] with K = 4"),
    (
        "transposed_contraction",
        lambda l, r, s: ((l, r, s), {"transpose_rhs": True}),
        r"rhs must be \[G, N, K\] with K = 8",
    ),
    ("dtype_mismatch", lambda l, r, s: ((l, r.astype(jnp.bfloat16), s), {}), "lhs and rhs must share a dtype"),
    ("int_lhs", lambda l, r, s: ((l.astype(jnp.int32), r, s), {}), "lhs must be float32, bfloat16 or float16"),
    ("sizes_length", lambda l, r, s: ((l, r, s[:2]), {}), r"group_sizes must be a 1-D integer array \[G\] = \[3\]"),
    ("sizes_float", lambda l, r, s: ((l, r, s.astype(jnp.float32)), {}), "group_sizes must be a 1-D integer"),
    (
        "preferred_int",
        lambda l, r, s: ((l, r, s), {"preferred_element_type": jnp.int32}),
        "preferred_element_type must be",
    ),
    (
        "preferred_junk",
        lambda l, r, s: ((l, r, s), {"preferred_element_type": "junk"}),
        "preferred_element_type must be",
    ),
    ("no_groups", lambda l, r, s: ((l, r[:0], s[:0]), {}), "at least one group"),
    ("unknown_option", lambda l, r, s: ((l, r, s), {"transpose_lhs": True}), "transpose_lhs"),
]


@pytest.mark.parametrize(("name", "make", "message"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_are_refused_with_a_clear_error(impl, name, make, message):
    args, kwargs = make(jnp.ones((12, 8)), jnp.ones((3, 8, 6)), jnp.array([4, 4, 4], jnp.int32))
    with pytest.raises((ValueError, TypeError), match=message):
        call(impl, *args, **kwargs)
