"""Conformance suite of the attention-block contract: ``flash_attention_block`` (forward) and
``flash_attention_block_bwd`` (backward), every installed implementation against the dense float32 references.

The backward implementation under test is the one of the same name as the forward's (skipped where there is
none). Besides each op on its own, the suite checks what a schedule relies on: partial results over key blocks
(with global positions: a zigzag shard of queries against two shards of keys) merged by log-sum-exp give the
rows of ``flash_attention`` on the whole sequence, and the per-block backward with the *global* ``out``/``lse``
gives its gradients (the log-sum-exp's cotangent included).

Layout: B batch, T queries, S keys, H query heads, K kv heads, D head dim, Dv value dim.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.kernels import kernel_registry
from ejkernel.kernels.signatures._attention import combine
from ejkernel.modules import flash_attention_block, flash_attention_block_bwd
from ejkernel.modules.operations.flash_attention_block import _bwd_kernel, _kernel
from ejkernel.testing import reference as _reference
from ejkernel.testing.conformance._harness import (
    FWD_RTOL,
    GRAD_RTOL,
    assert_close,
    call_forced,
    check_candidate_configs,
    dtype_cases,
    fresh_key,
    implementations_under_test,
    skip_if_unsupported,
)

reference: Any = _reference  # called with arguments built at run time (mypy cannot match them to signatures)
OP = "flash_attention_block"
OP_BWD = "flash_attention_block_bwd"


def pytest_generate_tests(metafunc: Any) -> None:
    if "impl" in metafunc.fixturenames:
        metafunc.parametrize("impl", implementations_under_test(metafunc.config, OP))


def bwd_of(impl: Any) -> Any:
    """The backward op's implementation of the same name as ``impl`` (skips the test when there is none)."""
    found = [i for i in kernel_registry.implementations(OP_BWD, backend="all") if i.name == impl.name]
    if not found:
        pytest.skip(f"{impl.name} registers no {OP_BWD}")
    return found[0]


@dataclasses.dataclass(frozen=True)
class Case:
    """A block call; ``positions``: None (the default alignment), ``"shifted"`` (an offset, as a contiguous ring
    step) or ``"sorted"`` (random non-decreasing, with repeats and gaps)."""

    name: str
    b: int = 2
    t: int = 16
    s: int = 24
    h: int = 4
    k: int = 2
    d: int = 16
    dv: int | None = None
    options: tuple[tuple[str, Any], ...] = ()
    positions: str | None = None
    segments: bool = False


CAUSAL = (("causal", True),)
CASES = [
    Case("plain_gqa"),
    Case("causal_default_alignment", options=CAUSAL),
    Case("causal_shifted_positions_empty_rows", t=20, s=12, positions="shifted", options=CAUSAL),
    Case("causal_window_sorted_positions", positions="sorted", options=(("causal", True), ("sliding_window", (5, 2)))),
    Case("window_only_sorted_positions", positions="sorted", options=(("sliding_window", (3, 6)),)),
    Case("segments_soft_cap_scale_mqa", k=1, positions="shifted", segments=True,
         options=(("causal", True), ("logits_soft_cap", 2.0), ("softmax_scale", 0.7))),
    Case("dv_differs_t_gt_s", t=24, s=16, dv=24, options=(("sliding_window", 4),)),
]  # fmt: skip
DTYPE_CASES = dtype_cases(
    CASES, {"causal_window_sorted_positions": ("bfloat16",), "segments_soft_cap_scale_mqa": ("float16",)}
)


def make(case: Case, dtype: str, seed: int) -> tuple[tuple[Any, ...], dict[str, Any], dict[str, Any]]:
    """``(q, k, v)``, the mask arrays (positions, segment ids) and the options of ``case``."""
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape, np.float32), dtype)

    dv = case.dv or case.d
    args = (
        normal(case.b, case.t, case.h, case.d),
        normal(case.b, case.s, case.k, case.d),
        normal(case.b, case.s, case.k, dv),
    )
    arrays: dict[str, Any] = {}
    if case.positions == "shifted":  # queries 10.. against keys 14..: the first rows see no key under causal
        arrays["q_positions"] = jnp.arange(case.t, dtype=jnp.int32) + 10
        arrays["kv_positions"] = jnp.arange(case.s, dtype=jnp.int32) + 14
    elif case.positions == "sorted":
        arrays["q_positions"] = jnp.asarray(np.sort(rng.integers(0, 2 * case.t, case.t)), jnp.int32)
        arrays["kv_positions"] = jnp.asarray(np.sort(rng.integers(0, 2 * case.s, case.s)), jnp.int32)
    if case.segments:
        qs = np.sort(rng.integers(0, 3, (case.b, case.t)), axis=-1)
        qs[:, -1] = 7  # a segment without keys: a row that admits none
        arrays["q_segment_ids"] = jnp.asarray(qs, jnp.int32)
        arrays["kv_segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, (case.b, case.s)), axis=-1), jnp.int32)
    return args, arrays, dict(case.options)


def forced(fn: Any, impl: Any, **static: Any) -> Any:
    """``fn`` forced onto ``impl``, compiled once (arrays traced, ``static`` options static)."""
    return jax.jit(lambda args, arrays: call_forced(fn, impl, *args, **arrays, **static))


def assert_lse_close(got: Any, want: Any, rtol: float, what: str, seed: int) -> None:
    assert got.dtype == jnp.float32, f"{what}: lse dtype {got.dtype} != float32"
    finite = np.isfinite(np.asarray(want))
    assert np.array_equal(np.isfinite(np.asarray(got)), finite), f"{what}: lse is -inf on other rows (seed {seed})"
    assert np.all(np.asarray(got)[~finite] == -np.inf), f"{what}: rows without keys must have lse = -inf"
    assert_close(jnp.where(finite, got, 0.0), jnp.where(finite, want, 0.0), rtol, what, seed)


@pytest.mark.parametrize(("case", "dtype"), DTYPE_CASES)
def test_forward_matches_reference(impl, case, dtype):
    _, seed = fresh_key()
    args, arrays, options = make(case, dtype, seed)
    skip_if_unsupported(impl, _kernel, flash_attention_block, args, {**arrays, **options})
    out, lse = forced(flash_attention_block, impl, **options)(args, arrays)
    want_out, want_lse = reference.flash_attention_block(*args, **arrays, **options)
    assert out.dtype == jnp.float32, f"out dtype {out.dtype} != float32 (the contract's partial results are float32)"
    assert_close(out, want_out, FWD_RTOL[dtype], f"{case.name} out", seed)
    assert_lse_close(lse, want_lse, FWD_RTOL[dtype], f"{case.name} lse", seed)
    empty = ~np.isfinite(np.asarray(want_lse)).transpose(0, 2, 1)  # [B, T, H]
    if case.positions == "shifted" or case.segments:
        assert empty.any(), "the case must have rows that admit no key"
    assert np.all(np.asarray(out)[empty] == 0), "rows without keys must be exactly zero"


@pytest.mark.parametrize(("case", "dtype"), DTYPE_CASES)
def test_backward_matches_reference(impl, case, dtype):
    bwd = bwd_of(impl)
    _, seed = fresh_key()
    args, arrays, options = make(case, dtype, seed)
    out, lse = reference.flash_attention_block(*args, **arrays, **options)
    dout = jnp.asarray(np.random.default_rng(seed + 1).standard_normal(out.shape), dtype)
    bargs = (*args, out, lse, dout)
    skip_if_unsupported(bwd, _bwd_kernel, flash_attention_block_bwd, bargs, {**arrays, **options})
    got = forced(flash_attention_block_bwd, bwd, **options)(bargs, arrays)
    want = reference.flash_attention_block_bwd(*bargs, **arrays, **options)
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert g.dtype == jnp.float32, f"{name} dtype {g.dtype} != float32"
        assert_close(g, w, GRAD_RTOL[dtype], f"{case.name} {name}", seed)


def test_blocks_merge_into_the_whole_attention(impl):
    """A schedule's use: the queries of a zigzag shard (global positions 0..7 and 24..31 of 32) against the key
    shards of two devices, merged by log-sum-exp, are those rows of ``flash_attention`` on the whole sequence;
    the per-block backward with the global ``out``/``lse`` (and a cotangent of ``lse`` too) gives its gradients."""
    bwd = bwd_of(impl)
    _, seed = fresh_key()
    rng = np.random.default_rng(seed)
    b, n, h, kh, d = 2, 32, 4, 2, 16
    q, k, v = (jnp.asarray(rng.standard_normal((b, n, x, d), np.float32)) for x in (h, kh, kh))
    segs = jnp.asarray(np.sort(rng.integers(0, 2, (b, n)), axis=-1), jnp.int32)
    options: dict[str, Any] = {"causal": True, "sliding_window": (13, 0), "logits_soft_cap": 5.0}
    mine = np.r_[0:8, 24:32]  # this device's queries (and its own key shard)
    shards = [mine, np.r_[8:24]]  # the key shards that visit it
    dout = jnp.asarray(rng.standard_normal((b, len(mine), h, d), np.float32))
    dlse = jnp.asarray(rng.standard_normal((b, h, len(mine)), np.float32))

    def whole(q: Any, k: Any, v: Any) -> Any:
        out, lse = reference.flash_attention(
            q, k, v, q_segment_ids=segs, kv_segment_ids=segs, return_lse=True, **options
        )
        return out[:, mine], lse[:, :, mine]

    (want_out, want_lse), vjp = jax.vjp(whole, q, k, v)
    finite = jnp.isfinite(want_lse)
    want_grads = vjp((dout, jnp.where(finite, dlse, 0.0)))

    def masks(keys: np.ndarray) -> dict[str, Any]:
        return {
            "q_positions": jnp.asarray(mine, jnp.int32),
            "kv_positions": jnp.asarray(keys, jnp.int32),
            "q_segment_ids": segs[:, mine],
            "kv_segment_ids": segs[:, keys],
        }

    fwd, back = forced(flash_attention_block, impl, **options), forced(flash_attention_block_bwd, bwd, **options)
    qm = q[:, mine]
    out, lse = jnp.zeros((b, len(mine), h, d), jnp.float32), jnp.full((b, h, len(mine)), -jnp.inf, jnp.float32)
    for keys in shards:
        out, lse = combine(out, lse, *fwd((qm, k[:, keys], v[:, keys]), masks(keys)))
    assert_close(out, want_out, FWD_RTOL["float32"], "merged out", seed)
    assert_lse_close(lse, want_lse, FWD_RTOL["float32"], "merged lse", seed)

    dq, dk, dv = jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
    for keys in shards:
        g = back((qm, k[:, keys], v[:, keys], out, lse, dout), {**masks(keys), "dlse": jnp.where(finite, dlse, 0.0)})
        dq = dq.at[:, mine].add(g[0])
        dk, dv = dk.at[:, keys].add(g[1]), dv.at[:, keys].add(g[2])
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), want_grads, strict=True):
        assert_close(got, want, GRAD_RTOL["float32"], f"merged {name}", seed)


def test_public_function_is_differentiable_in_both_outputs(impl):
    bwd_of(impl)
    _, seed = fresh_key()
    case = Case("grad", positions="sorted", segments=True, options=(("causal", True), ("sliding_window", (6, 1))))
    args, arrays, options = make(case, "float32", seed)
    skip_if_unsupported(impl, _kernel, flash_attention_block, args, {**arrays, **options})
    rng = np.random.default_rng(seed + 1)
    want_out, want_lse = reference.flash_attention_block(*args, **arrays, **options)
    cot = (
        jnp.asarray(rng.standard_normal(want_out.shape), jnp.float32),
        jnp.where(jnp.isfinite(want_lse), jnp.asarray(rng.standard_normal(want_lse.shape), jnp.float32), 0.0),
    )

    def grads(fn: Any) -> Any:
        return jax.jit(lambda a: jax.vjp(lambda *x: fn(*x, **arrays, **options), *a)[1](cot))(args)

    got = grads(lambda *a, **kw: call_forced(flash_attention_block, impl, *a, **kw))
    want = grads(reference.flash_attention_block)
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert g.dtype == w.dtype, f"{name} dtype {g.dtype} != {w.dtype}"
        assert_close(g, w, GRAD_RTOL["float32"], f"vjp {name}", seed)


@pytest.mark.parametrize("op", [OP, OP_BWD])
def test_every_candidate_config_matches_reference(impl, op, tier):
    """Each launch configuration an implementation offers the autotuner, for lengths of several partial tiles."""
    impl = impl if op == OP else bwd_of(impl)
    _, seed = fresh_key()
    case = Case("candidates", t=37, s=45, positions="sorted", segments=True, options=CAUSAL)
    args, arrays, options = make(case, "float32", seed)
    kernel: Any
    fn: Any
    expected: Any
    if op == OP:
        kernel, fn, call_args = _kernel, flash_attention_block, args
        expected = lambda: reference.flash_attention_block(*args, **arrays, **options)  # noqa: E731
    else:
        out, lse = reference.flash_attention_block(*args, **arrays, **options)
        dout = jnp.asarray(np.random.default_rng(seed + 1).standard_normal(out.shape), jnp.float32)
        kernel, fn, call_args = _bwd_kernel, flash_attention_block_bwd, (*args, out, lse, dout)
        expected = lambda: reference.flash_attention_block_bwd(*call_args, **arrays, **options)  # noqa: E731
    skip_if_unsupported(impl, kernel, fn, call_args, {**arrays, **options})

    def check(cfg: Any, want: Any) -> None:
        got = jax.jit(lambda a, arr: fn(*a, **arr, **options, cfg=cfg))(call_args, arrays)
        if op == OP:
            assert_close(got[0], want[0], FWD_RTOL["float32"], "out", seed)
            assert_lse_close(got[1], want[1], FWD_RTOL["float32"], "lse", seed)
        else:
            for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
                assert_close(g, w, GRAD_RTOL["float32"], name, seed)

    check_candidate_configs(impl, kernel, call_args, {**arrays, **options}, check, tier=tier, expected=expected,
                            differentiable=False)  # fmt: skip


def test_empty_blocks_give_zeros_and_minus_infinity(impl):
    q = jnp.ones((2, 5, 4, 8))
    out, lse = call_forced(flash_attention_block, impl, q, jnp.ones((2, 0, 2, 8)), jnp.ones((2, 0, 2, 8)))
    assert out.shape == (2, 5, 4, 8) and out.dtype == jnp.float32 and not np.asarray(out).any()
    assert lse.shape == (2, 4, 5) and np.all(np.asarray(lse) == -np.inf)


BAD_INPUTS = [
    ("positions_half", {"q_positions": jnp.arange(8)}, "pass both q_positions and kv_positions"),
    ("positions_shape", {"q_positions": jnp.arange(7), "kv_positions": jnp.arange(8)}, r"q_positions must be .*\[8\]"),
    ("positions_float", {"q_positions": jnp.ones(8), "kv_positions": jnp.arange(8)}, "q_positions must be an integer"),
    ("positions_unsorted", {"q_positions": jnp.arange(8), "kv_positions": jnp.asarray([0, 1, 2, 5, 4, 6, 7, 8])},
     r"kv_positions must be non-decreasing, got kv_positions\[4\] = 4 after kv_positions\[3\] = 5"),
    ("window", {"sliding_window": (-1, 2)}, "sliding_window must be"),
    ("soft_cap", {"logits_soft_cap": 0.0}, "logits_soft_cap must be a positive"),
    ("segments_half", {"q_segment_ids": jnp.zeros((2, 8), jnp.int32)}, "pass both q_segment_ids"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "kwargs", "message"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_are_refused_with_a_clear_error(impl, name, kwargs, message):
    q = jnp.ones((2, 8, 4, 16))
    k = v = jnp.ones((2, 8, 2, 16))
    with pytest.raises((ValueError, TypeError), match=rf"^{OP}\b.*{message}"):
        call_forced(flash_attention_block, impl, q, k, v, **kwargs)


def test_bad_backward_inputs_are_refused_with_a_clear_error(impl):
    bwd = bwd_of(impl)
    q = jnp.ones((2, 8, 4, 16))
    k = v = jnp.ones((2, 8, 2, 16))
    out, lse = jnp.ones((2, 8, 4, 16)), jnp.zeros((2, 4, 8))
    with pytest.raises(ValueError, match=rf"^{OP_BWD}: lse must be a float array of shape \[2, 4, 8\]"):
        call_forced(flash_attention_block_bwd, bwd, q, k, v, out, lse[:, :, :3], out)
    with pytest.raises(ValueError, match=rf"^{OP_BWD}: dout must be a float array"):
        call_forced(flash_attention_block_bwd, bwd, q, k, v, out, lse, out[..., :8])
