"""Conformance suite of ``mean_pooling``: every installed implementation against the reference.

Layout: B batch, T length, D features, N packed sequences.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from ejkernel.modules import mean_pooling
from ejkernel.modules.operations.mean_pooling import _kernel
from ejkernel.testing import reference
from ejkernel.testing.conformance._harness import (
    DTYPES,
    FWD_RTOL,
    GRAD_RTOL,
    assert_close,
    call_forced,
    check_candidate_configs,
    fresh_key,
    implementations_under_test,
    jitted,
)
from ejkernel.testing.conformance._harness import skip_if_unsupported as _skip_if_unsupported

OP = "mean_pooling"


def pytest_generate_tests(metafunc: Any) -> None:
    if "impl" in metafunc.fixturenames:
        metafunc.parametrize("impl", implementations_under_test(metafunc.config, OP))


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    b: int = 3
    t: int = 37
    d: int = 24
    cu_seqlens: tuple[int, ...] | None = None


CASES = [
    Case("batch"),
    Case("batch_one_length_one", b=1, t=1),
    # lengths 9, 0, 1, 19; the last 8 tokens are outside every sequence
    Case("varlen_empty_and_length_one", b=1, cu_seqlens=(0, 9, 9, 10, 29)),
    Case("varlen_offset_start", b=1, t=20, cu_seqlens=(3, 20)),  # tokens 0..2 count for nothing
]
# The GPU tier's realistic shapes: long sequences of wide features; packed ones of thousands of tokens, one empty.
GPU_CASES = [
    Case("gpu_batch", b=8, t=4099, d=1024),
    Case("gpu_varlen", b=1, t=8192, d=1024, cu_seqlens=(0, 1, 3000, 3000, 8000)),
]
GPU_DTYPE_CASES = [pytest.param(c, d, id=f"{c.name}-{d}") for c in GPU_CASES for d in ("bfloat16", "float32")]


def make_inputs(case: Case, dtype: str, key: jax.Array) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = jax.random.normal(key, (case.b, case.t, case.d), jnp.float32).astype(dtype)
    kwargs = {} if case.cu_seqlens is None else {"cu_seqlens": jnp.array(case.cu_seqlens, jnp.int32)}
    return (x,), kwargs


def call(impl: Any, *args: Any, **kwargs: Any) -> Any:
    return call_forced(mean_pooling, impl, *args, **kwargs)


def skip_if_unsupported(impl: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    _skip_if_unsupported(impl, _kernel, mean_pooling, args, kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_forward_and_gradient_match_reference(impl, case, dtype):
    check_case(impl, case, dtype)


@pytest.mark.parametrize(("case", "dtype"), GPU_DTYPE_CASES)
def test_gpu_tier_forward_and_gradient_match_reference(impl, case, dtype, gpu_tier):
    check_case(impl, case, dtype)


def test_every_candidate_config_matches_reference(impl, tier):
    """Each launch configuration the implementation offers the autotuner computes the same thing."""
    case = Case("candidates", b=2, t=80)
    key, _ = fresh_key()
    args, kwargs = make_inputs(case, "float32", key)
    skip_if_unsupported(impl, args, kwargs)
    check_candidate_configs(
        impl, _kernel, args, kwargs, lambda cfg, _: check_case(impl, case, "float32", cfg), tier=tier
    )


def check_case(impl: Any, case: Case, dtype: str, cfg: Any = None) -> None:
    """The output and the gradient against the reference's (with ``cfg``: that launch configuration)."""
    key, seed = fresh_key()
    args, kwargs = make_inputs(case, dtype, key)
    skip_if_unsupported(impl, args, kwargs)
    n = case.b if case.cu_seqlens is None else len(case.cu_seqlens) - 1
    cot = jax.random.normal(jax.random.fold_in(key, 1), (n, case.d)).astype(dtype)

    def fwd_bwd(fn):
        def run(x, **kw):
            out, vjp = jax.vjp(lambda x: fn(x, **kw), x)
            return out, vjp(cot)[0]

        return jitted(run, **kwargs)(*args)

    out, dx = fwd_bwd(lambda *a, **kw: call(impl, *a, cfg=cfg, **kw))
    want, want_dx = fwd_bwd(reference.mean_pooling)
    assert out.dtype == jnp.dtype(dtype), f"output dtype {out.dtype} != input dtype {dtype}"
    assert dx.dtype == jnp.dtype(dtype), f"dx dtype {dx.dtype} != input dtype {dtype}"
    assert_close(out, want, FWD_RTOL[dtype], f"{case.name} forward", seed)
    assert_close(dx, want_dx, GRAD_RTOL[dtype], f"{case.name} dx", seed)


@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=lambda c: c.name)
def test_check_grads_numerically(impl, case):
    key, seed = fresh_key()
    args, kwargs = make_inputs(dataclasses.replace(case, d=4), "float32", key)
    skip_if_unsupported(impl, args, kwargs)
    check_grads(lambda x: call(impl, x, **kwargs), args, order=1, modes=("rev",), atol=1e-2, rtol=1e-2, eps=1e-2)


def test_empty_sequences_give_zeros_and_finite_gradients(impl):
    key, seed = fresh_key()
    x = jax.random.normal(key, (1, 12, 5))
    cu = jnp.array([0, 0, 4, 4, 12, 12], jnp.int32)  # sequences 0, 2 and 4 are empty
    skip_if_unsupported(impl, (x,), {"cu_seqlens": cu})
    out, vjp = jax.vjp(lambda x: call(impl, x, cu_seqlens=cu), x)
    assert np.all(np.isfinite(out)), f"NaN/inf in the output (seed {seed})"
    assert np.all(np.asarray(out[jnp.array([0, 2, 4])]) == 0), "empty sequences must give exactly zero"
    np.testing.assert_allclose(np.asarray(out[1]), np.asarray(x[0, :4].mean(0)), rtol=1e-5, atol=1e-6)
    (dx,) = vjp(jnp.ones_like(out))
    assert np.all(np.isfinite(dx)), f"dx has NaN/inf (seed {seed})"
    np.testing.assert_allclose(np.asarray(dx[0, :4]), 0.25, rtol=1e-6)


def test_accumulates_in_float32(impl):
    # 4096 values near 1 in bfloat16: a bfloat16 running sum stalls at 256 (256 + 1 rounds to 256).
    key, seed = fresh_key()
    x = (1.0 + 0.01 * jax.random.normal(key, (1, 4096, 8))).astype(jnp.bfloat16)
    cu = jnp.array([0, 4096], jnp.int32)
    skip_if_unsupported(impl, (x,), {})
    want = np.asarray(x, np.float64).mean(axis=1)
    for kwargs in ({}, {"cu_seqlens": cu}):
        got = np.asarray(call(impl, x, **kwargs), np.float64)
        np.testing.assert_allclose(got, want, rtol=1e-2, err_msg=f"{kwargs} (seed {seed})")


def test_jit_and_vmap_agree_with_eager(impl):
    key, seed = fresh_key()
    x = jax.random.normal(key, (2, 11, 6))
    skip_if_unsupported(impl, (x,), {})
    eager = call(impl, x)
    assert_close(jax.jit(lambda x: call(impl, x))(x), eager, 1e-6, "jit", seed)
    vmapped = jax.vmap(lambda x: call(impl, x))(x[:, None])[:, 0]
    assert_close(vmapped, eager, 1e-6, "vmap", seed)


BAD_INPUTS = [
    ("ndim", lambda x: ((x[0],), {}), r"x must be 3-D \[B, T, D\]"),
    ("int_x", lambda x: ((x.astype(jnp.int32),), {}), "x must be float32, bfloat16 or float16"),
    ("varlen_batch", lambda x: ((x,), {"cu_seqlens": jnp.array([0, 8])}), "batch must be 1"),
    ("cu_float", lambda x: ((x[:1],), {"cu_seqlens": jnp.array([0.0, 8.0])}), "cu_seqlens must be a 1-D integer"),
    (
        "cu_short",
        lambda x: ((x[:1],), {"cu_seqlens": jnp.array([0])}),
        r"cu_seqlens must be a 1-D integer array \[N\+1\]",
    ),
    ("unknown_option", lambda x: ((x,), {"seqlens": None}), "seqlens"),
]


@pytest.mark.parametrize(("name", "make", "message"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_are_refused_with_a_clear_error(impl, name, make, message):
    args, kwargs = make(jnp.ones((2, 8, 4)))
    with pytest.raises((ValueError, TypeError), match=message):
        call(impl, *args, **kwargs)
