"""What the linear-attention conformance suites (``gla``, ``lightning_attn``, ``recurrent``) share.

Layout: B batch, T length, H heads, K query/key head dim, V value head dim, N packed sequences; HV value heads
(``Case.hv``, a multiple of H: ``gla`` and ``gated_delta_rule`` only), which ``v``, the gates and the state have.

Inputs are built by name in a dict (``q``, ``k``, ``v``, gates, ``initial_state``, ``cu_seqlens``), so one
helper computes the output, the final state and the gradient of every float input for any of the ops,
on the implementation under test and on the reference (each jitted whole).

Tolerances: every implementation accumulates in float32, so the harness's ``FWD_RTOL``/``GRAD_RTOL`` hold
for the output and the gradients (the dtype's rounding of the inputs and outputs dominates: both sides
round the same float32 values). The final state is float32 whatever the input dtype and is compared
with the float32 tolerance scaled by the length (``state_rtol``): it sums T terms in an order each
implementation chooses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.testing.conformance._harness import (
    FWD_RTOL,
    GRAD_RTOL,
    assert_close,
    assert_jit_and_vmap_agree_with_eager,
    call_forced,
    check_candidate_configs,
    check_grads_numerically,
    first_served,
)


@dataclasses.dataclass(frozen=True)
class Case:
    """One call: sizes, which optional inputs exist, packing, which gates (``recurrent``) and how strong."""

    name: str
    b: int = 2
    t: int = 37  # not a multiple of any chunk size
    h: int = 3
    hv: int | None = None  # value heads (grouped: a multiple of h); None: h
    dk: int = 16
    dv: int = 12
    initial_state: bool = True
    final_state: bool = True
    cu_seqlens: tuple[int, ...] | None = None
    gates: tuple[str, ...] = ()  # the optional gate inputs the case passes
    gate_scale: float = 0.25  # log gates are gate_scale * log_sigmoid(x): about -0.2 per step
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def n(self) -> int:
        return self.b if self.cu_seqlens is None else len(self.cu_seqlens) - 1

    @property
    def heads_v(self) -> int:
        """The heads of ``v``, the gates and the state: ``hv``, else ``h``."""
        return self.h if self.hv is None else self.hv


# The GPU tier's realistic shapes: head dims 128, lengths of many chunks of any size and a multiple of none;
# packed sequences of a few hundred to a thousand tokens, one empty, with tokens after the last.
GPU_CASES = [
    Case("gpu_long", b=2, t=1031, h=4, dk=128, dv=128),
    Case("gpu_varlen", b=1, t=2053, h=4, dk=128, dv=128, cu_seqlens=(0, 1, 700, 700, 1709, 2040)),
]
# Decode steps at realistic head dims (gla, gated_delta_rule: the fused recurrent kernels' shapes): a batch of 64
# two-token steps with grouped value heads, and packed steps of 0 to 4 tokens.
GPU_DECODE_CASES = [
    Case("gpu_decode", b=64, t=2, h=4, hv=8, dk=128, dv=128),
    Case("gpu_decode_packed", b=1, t=18, h=4, dk=128, dv=128, cu_seqlens=(0, 1, 3, 3, 7, 8, 12, 13, 16)),
]
# Every candidate chunk: a length of several chunks of each (16, 32, 64), a multiple of none; for the fused
# recurrent (decode) kernels, which decline that length, decode steps of a few tokens. The candidate tests take the
# first of the two an implementation serves.
CANDIDATE_CASE = Case("candidates", b=1, t=80, h=2, dk=16, dv=12)
DECODE_CANDIDATE_CASE = Case("decode_candidates", b=3, t=5, h=2, dk=16, dv=12)
CANDIDATE_CASES = (CANDIDATE_CASE, DECODE_CANDIDATE_CASE)


def normal(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
    """Standard normal values drawn with NumPy (``jax.random`` would compile a program per shape)."""
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)


def log_gate(rng: np.random.Generator, shape: tuple[int, ...], scale: float, dtype: Any = jnp.float32) -> jax.Array:
    """Log decays ``<= 0``: ``scale * log_sigmoid(x)`` with ``x`` standard normal."""
    x = rng.standard_normal(shape).astype(np.float32)
    return jnp.asarray(scale * -np.logaddexp(0.0, -x)).astype(dtype)


def base_inputs(case: Case, dtype: str, rng: np.random.Generator) -> dict[str, Any]:
    """``q``, ``k``, ``v`` (in ``dtype``), ``initial_state`` (float32) and ``cu_seqlens`` as the case asks."""
    arrays: dict[str, Any] = {
        "q": normal(rng, (case.b, case.t, case.h, case.dk), dtype),
        "k": normal(rng, (case.b, case.t, case.h, case.dk), dtype),
        "v": normal(rng, (case.b, case.t, case.heads_v, case.dv), dtype),
    }
    if case.initial_state:
        arrays["initial_state"] = normal(rng, (case.n, case.heads_v, case.dk, case.dv))
    if case.cu_seqlens is not None:
        arrays["cu_seqlens"] = jnp.asarray(case.cu_seqlens, jnp.int32)
    return arrays


def is_float(x: Any) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating)


def outputs_and_grads(
    fn: Callable[..., Any], arrays: dict[str, Any], options: dict[str, Any], seed: int
) -> tuple[Any, Any, dict[str, Any]]:
    """``(o, final_state, {name: gradient})`` of ``sum(o * r1) + sum(final_state * r2)`` (random ``r``) with
    respect to every float array, compiled whole (one compilation; much faster on CPU than op by op)."""
    diff = {n: x for n, x in arrays.items() if is_float(x)}
    fixed = {n: x for n, x in arrays.items() if n not in diff}
    # Random cotangents, the same for both sides when ``seed`` is.
    o_shape, state_shape = jax.eval_shape(lambda d: fn(**d, **fixed, **options), diff)
    rng = np.random.default_rng(seed)
    r1 = normal(rng, o_shape.shape)
    r2 = None if state_shape is None else normal(rng, state_shape.shape)

    def loss(d: dict[str, Any], r1: jax.Array, r2: jax.Array | None) -> tuple[jax.Array, tuple[Any, Any]]:
        o, state = fn(**d, **fixed, **options)
        total = jnp.sum(o.astype(jnp.float32) * r1)
        if state is not None:
            total = total + jnp.sum(state * r2)
        return total, (o, state)

    run = jax.value_and_grad(loss, has_aux=True)
    (_, (o, state)), grads = jax.jit(run)(diff, r1, r2)
    return o, state, grads


def state_rtol(t: int) -> float:
    """The final state is float32 in every dtype: float32 tolerance, growing with the terms summed."""
    return FWD_RTOL["float32"] * max(1.0, t / 16)


def check_against_reference(
    got: tuple[Any, Any, dict[str, Any]],
    want: tuple[Any, Any, dict[str, Any]],
    case: Case,
    dtype: str,
    seed: int,
    *,
    grads: bool = True,
) -> None:
    """Output dtype and values, final state (float32 or None) and every gradient against the reference; with
    ``cu_seqlens``, tokens outside every sequence give exact zeros and zero ``dq``."""
    o, state, g = got
    o_ref, state_ref, g_ref = want
    assert o.dtype == jnp.dtype(dtype), f"{case.name}: output dtype {o.dtype} != input dtype {dtype}"
    assert np.all(np.isfinite(np.asarray(o, np.float32))), f"{case.name}: NaN/inf in the output (seed {seed})"
    assert_close(o, o_ref, FWD_RTOL[dtype], f"{case.name} {dtype} output", seed)
    if state_ref is None:
        assert state is None, f"{case.name}: output_final_state=False must give None, got {type(state).__name__}"
    else:
        assert state.dtype == jnp.float32, f"{case.name}: the final state must be float32, got {state.dtype}"
        assert_close(state, state_ref, state_rtol(case.t), f"{case.name} {dtype} final state", seed)
    if grads:
        assert set(g) == set(g_ref)
        for name in g_ref:
            assert g[name].dtype == g_ref[name].dtype, f"d{name} dtype {g[name].dtype} != {g_ref[name].dtype}"
            rtol = GRAD_RTOL[dtype] if g_ref[name].dtype == jnp.dtype(dtype) else GRAD_RTOL["float32"] * 10
            assert_close(g[name], g_ref[name], rtol, f"{case.name} {dtype} d{name}", seed)
    if case.cu_seqlens is not None:
        end = case.cu_seqlens[-1]
        assert np.all(np.asarray(o[:, end:]) == 0), "tokens after cu_seqlens[-1] must give zeros"
        if grads:
            assert np.all(np.asarray(g["q"][:, end:]) == 0), "tokens after cu_seqlens[-1] must have zero dq"


def check_grads_in(fn: Callable[..., Any], arrays: dict[str, Any], names: tuple[str, ...]) -> None:
    """Finite differences of ``fn(**arrays)`` (output and final state) in the inputs ``names``."""
    fixed = {n: x for n, x in arrays.items() if n not in names}
    check_grads_numerically(lambda *xs: fn(**dict(zip(names, xs)), **fixed), tuple(arrays[n] for n in names))


def assert_jit_and_vmap_agree(fn: Callable[..., Any], arrays: dict[str, Any], seed: int) -> None:
    """``fn(**arrays)`` (output and final state) is the same eager, under ``jit`` and under ``vmap`` over a new
    leading axis of one (not the batch: ``lightning_attn``'s ``slope`` has none)."""
    assert_jit_and_vmap_agree_with_eager(
        lambda a: fn(**a), (arrays,), seed, jit_rtol=1e-5, add_axis=lambda x: x[None], drop_axis=lambda x: x[0]
    )


def assert_split_equals_carrying_the_state(
    fn: Callable[..., Any], arrays: dict[str, Any], time_inputs: tuple[str, ...], at: int, seed: int
) -> None:
    """Running T tokens at once equals running the first ``at``, then the rest from their final state: the state
    is the whole memory of the recurrence (what decoding relies on). ``fn(**arrays)`` returns
    ``(o, final_state)``; ``time_inputs`` are the inputs with a time axis (axis 1)."""
    whole, state = fn(**arrays)
    first = {n: (x[:, :at] if n in time_inputs else x) for n, x in arrays.items()}
    o1, s1 = fn(**first)
    rest = {**{n: (x[:, at:] if n in time_inputs else x) for n, x in arrays.items()}, "initial_state": s1}
    o2, s2 = fn(**rest)
    assert_close(jnp.concatenate([o1, o2], axis=1), whole, 1e-5, "split output", seed)
    assert_close(s2, state, 1e-5, "split final state", seed)


def candidate_inputs(
    impl: Any, kernel: Any, make: Callable[[Case], tuple[dict[str, Any], dict[str, Any]]]
) -> tuple[Case, dict[str, Any], dict[str, Any]]:
    """``(case, arrays, options)`` of the first of ``CANDIDATE_CASES`` that ``impl`` serves (the last one when it
    serves neither: the caller's ``skip_if_unsupported`` then skips with the reason); ``make(case)`` builds the
    inputs, only those of the cases tried."""
    made = ((c, *make(c)) for c in CANDIDATE_CASES)
    return first_served(impl, kernel, ((m, (), {**m[1], **m[2]}) for m in made))


def check_every_candidate_config(
    impl: Any,
    kernel: Any,
    fn: Callable[..., Any],
    reference_fn: Callable[..., Any],
    case: Case,
    arrays: dict[str, Any],
    options: dict[str, Any],
    seed: int,
    tier: str,
) -> None:
    """``check_candidate_configs`` for a linear-attention op: output, final state and every gradient of ``fn`` forced
    onto ``impl`` with each candidate against ``reference_fn``'s."""

    def check(cfg: Any, want: Any) -> None:
        got = outputs_and_grads(lambda **kw: call_forced(fn, impl, cfg=cfg, **kw), arrays, options, seed)
        check_against_reference(got, want, case, "float32", seed)

    expected = lambda: outputs_and_grads(reference_fn, arrays, options, seed)  # noqa: E731
    check_candidate_configs(impl, kernel, (), {**arrays, **options}, check, tier=tier, expected=expected)
