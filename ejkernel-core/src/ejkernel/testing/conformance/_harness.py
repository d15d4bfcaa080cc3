"""Shared machinery of the conformance suites: which implementations to test, the tier, fresh inputs, tolerances,
and the checks every suite makes the same way (gradients, finite differences, jit/vmap, refusals, launch
configurations)."""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from ejkernel.kernels import kernel_registry
from ejkernel.kernels._types import current_backend
from ejkernel.kernels.signatures import OPS

DTYPES = ("float32", "bfloat16", "float16")
# Relative error ||out - ref|| / ||ref|| allowed per input dtype: float32 accumulation everywhere, so
# the error is dominated by rounding the inputs/outputs (bf16: 8 bits of mantissa, fp16: 11).
FWD_RTOL = {"float32": 2e-5, "bfloat16": 1.6e-2, "float16": 2e-3}
GRAD_RTOL = {"float32": 1e-4, "bfloat16": 4e-2, "float16": 6e-3}
# The CPU tier checks at most this many of an implementation's candidate launch configurations per stage, spread
# over its list (each is one compilation, and CI has 2 cores); the GPU tier checks every one.
CPU_TIER_CANDIDATES = 3
GPU_TIER_SKIP = "GPU tier (realistic shapes): run with --ejkernel-tier=gpu"


def implementations_under_test(config: Any, op: str) -> list[Any]:
    """``pytest.param``s of the implementations of ``op`` selected by ``--ejkernel-platform`` (a name, e.g.
    ``triton_interpret``, or a platform: all of its implementations) and ``--ejkernel-backend``."""
    platforms = set(config.getoption("ejkernel_platform", default=[]) or [])
    backend = config.getoption("ejkernel_backend", default=None) or current_backend()
    impls = [
        i
        for i in kernel_registry.implementations(op, backend=backend)
        if not platforms or i.platform in platforms or i.name in platforms
    ]
    if not impls:
        wanted = f" for platform(s) {sorted(platforms)}" if platforms else ""
        reason = (
            f"no implementation of {op}{wanted} installed for backend {backend!r} "
            f"(install one of: {', '.join(OPS[op].provided_by) if op in OPS else 'a plugin that provides it'})"
        )
        return [pytest.param(None, id="none-installed", marks=pytest.mark.skip(reason=reason))]
    return [pytest.param(i, id=i.name) for i in impls]


def parametrize_implementations(op: str) -> Callable[[Any], None]:
    """The suite's ``pytest_generate_tests``: every test taking ``impl`` runs once per implementation under test."""

    def pytest_generate_tests(metafunc: Any) -> None:
        if "impl" in metafunc.fixturenames:
            metafunc.parametrize("impl", implementations_under_test(metafunc.config, op))

    return pytest_generate_tests


def tier_of(config: Any) -> str:
    """The tier ``--ejkernel-tier`` asks for: ``"cpu"`` (the default: small shapes, as CI runs them) or ``"gpu"``."""
    return str(config.getoption("ejkernel_tier", default="cpu") or "cpu")


@pytest.fixture
def tier(request: Any) -> str:
    """The run's tier (``tier_of``), for tests that scale with it (how many launch configurations they check)."""
    return tier_of(request.config)


@pytest.fixture
def gpu_tier(request: Any) -> None:
    """Requested by the GPU tier's tests (realistic shapes, too slow for CI): skipped unless ``--ejkernel-tier=gpu``."""
    if tier_of(request.config) != "gpu":
        pytest.skip(GPU_TIER_SKIP)


@pytest.fixture(autouse=True)
def ejkernel_full_precision_matmuls() -> Any:
    """The suites run float32 matmuls at full precision: on GPUs JAX's default is TF32 (10 mantissa bits),
    which the suites' float32 tolerances do not allow, for an implementation and the reference alike.
    Autouse only where a ``conftest.py`` of the suites imports it (never in a user's own tests)."""
    with jax.default_matmul_precision("float32"):
        yield


def dtype_cases(cases: Sequence[Any], lower_precision: Mapping[str, Sequence[str]]) -> list[Any]:
    """``pytest.param(case, dtype)``, id ``name-dtype``: every case in float32, and the cases named in
    ``lower_precision`` also in the dtypes given there (compiling is what costs time on CI)."""
    return [pytest.param(c, "float32", id=f"{c.name}-float32") for c in cases] + [
        pytest.param(c, dtype, id=f"{c.name}-{dtype}") for c in cases for dtype in lower_precision.get(c.name, ())
    ]


def fresh_key() -> tuple[jax.Array, int]:
    """A new random key each run; the seed is returned so that a failure can be reproduced."""
    seed = int.from_bytes(os.urandom(4), "little")
    return jax.random.key(seed), seed


def relative_error(got: Any, want: Any) -> float:
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    want = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    denom = np.linalg.norm(want)
    return float(np.linalg.norm(got - want) / (denom if denom > 0 else 1.0))


def assert_close(got: Any, want: Any, rtol: float, what: str, seed: int) -> None:
    assert got.shape == want.shape, f"{what}: shape {got.shape} != reference {want.shape} (seed {seed})"
    err = relative_error(got, want)
    assert err <= rtol, f"{what}: relative error {err:.3g} > {rtol:g} (seed {seed})"


def assert_grads_close(
    names: Sequence[str], got: Sequence[Any], want: Sequence[Any], rtol: float, what: str, seed: int
) -> None:
    """Each gradient has the reference's dtype and values; ``names`` (``dq``, ``dk``, ...) may name more
    inputs than a call has (an optional ``bias`` last)."""
    assert len(got) == len(want) <= len(names), f"{what}: {len(got)} gradients, the reference has {len(want)}"
    for name, g, w in zip(names, got, want):
        assert g.dtype == w.dtype, f"{what} {name} dtype {g.dtype} != {w.dtype}"
        assert_close(g, w, rtol, f"{what} {name}", seed)


def assert_refused(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], message: str, op: str
) -> None:
    """``fn(*args, **kwargs)`` raises ValueError or TypeError, and the message starts with the op's name and
    matches ``message`` (a regular expression)."""
    with pytest.raises((ValueError, TypeError), match=rf"^{re.escape(op)}\b.*{message}"):
        fn(*args, **kwargs)


def check_grads_numerically(fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """Reverse-mode gradients of ``fn`` against finite differences, in float32 (tiny inputs: ``fn`` is
    evaluated many times; the tolerance is that of float32 differences with ``eps=1e-2``)."""
    with jax.enable_x64(False):
        check_grads(fn, args, order=1, modes=("rev",), atol=3e-2, rtol=3e-2, eps=1e-2)


def assert_jit_and_vmap_agree_with_eager(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    seed: int,
    *,
    jit_rtol: float = 1e-6,
    vmap_rtol: float = 1e-5,
    add_axis: Callable[[jax.Array], jax.Array] = lambda x: x[:, None],
    drop_axis: Callable[[jax.Array], jax.Array] = lambda x: x[:, 0],
) -> None:
    """``fn(*args)`` (arrays or pytrees of them, out likewise) is the same eager, under ``jit`` and under ``vmap``.
    By default ``vmap`` maps over the batch, each element a batch of one (``add_axis``/``drop_axis`` say
    where the mapped axis goes in and comes out)."""
    eager = jax.tree.leaves(fn(*args))
    jit_out = jax.tree.leaves(jax.jit(fn)(*args))
    vmapped = [drop_axis(x) for x in jax.tree.leaves(jax.vmap(fn)(*jax.tree.map(add_axis, args)))]
    for what, got, rtol in (("jit", jit_out, jit_rtol), ("vmap", vmapped, vmap_rtol)):
        assert len(got) == len(eager), f"{what}: {len(got)} outputs, eager gives {len(eager)}"
        for i, (g, e) in enumerate(zip(got, eager)):
            assert_close(g, e, rtol, f"{what} output {i}", seed)


def forward_and_vjp(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], cot: jax.Array) -> Any:
    """``(out, gradients of every positional input)`` of ``fn(*args, **kwargs)`` for the cotangent ``cot``,
    compiled as one program."""

    def both(*a: Any, **kw: Any) -> Any:
        out, vjp = jax.vjp(lambda *x: fn(*x, **kw), *a)
        return out, vjp(cot.astype(out.dtype))

    return jitted(both, **kwargs)(*args)


def call_forced(fn: Any, impl: Any, *args: Any, **kwargs: Any) -> Any:
    """The public function ``fn`` with exactly the implementation under test forced (``platform=`` its name, so
    that another implementation of the same platform, e.g. ``cudnn`` beside ``xla``, is not used)."""
    backend = None if impl.backend == "any" else impl.backend
    return fn(*args, platform=impl.name, backend=backend, **kwargs)


def jitted(fn: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` compiled once: array options are traced, the rest is static (compiling
    the whole call is much faster on CPU than dispatching it op by op)."""
    arrays = {k: v for k, v in kwargs.items() if isinstance(v, jax.Array)}
    static = {k: v for k, v in kwargs.items() if k not in arrays}
    compiled = jax.jit(lambda arr, *a: fn(*a, **arr, **static))
    return lambda *a: compiled(arrays, *a)


def invocation(impl: Any, kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The ``Invocation`` of ``kernel``'s call ``(*args, **kwargs)`` forced onto ``impl``, built as the executor builds
    it: arguments bound by canonical name and normalized, on the backend the call runs on."""
    from ejkernel.ops import Invocation

    backend = current_backend() if impl.backend == "any" else impl.backend
    return Invocation.create(kernel.op_id, kernel.normalize(kernel.bind(args, kwargs)), backend)


def first_served(impl: Any, kernel: Any, calls: Iterable[tuple[Any, tuple[Any, ...], dict[str, Any]]]) -> Any:
    """The ``what`` of the first of ``calls`` (``(what, args, kwargs)``) that ``impl`` serves; the last one's when it
    serves none (then the caller's ``skip_if_unsupported`` skips with the reason). For tests that need one call an
    implementation takes, whichever it is: a test that skips whenever an implementation declines one fixed call
    never checks that implementation."""
    last: Any = None
    for what, args, kwargs in calls:
        if impl.supports(invocation(impl, kernel, args, kwargs)) is None:
            return what
        last = what
    return last


def _spread(items: list[Any], n: int) -> list[Any]:
    """``n`` of ``items`` evenly spread from the first to the last (all of them when there are no more)."""
    if len(items) <= n:
        return items
    return [items[i] for i in np.linspace(0, len(items) - 1, n).round().astype(int)]


def check_candidate_configs(
    impl: Any,
    kernel: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    check: Callable[[Any, Any], None],
    *,
    tier: str,
    expected: Callable[[], Any] | None = None,
    differentiable: bool = True,
) -> None:
    """Every launch configuration that ``impl`` offers the autotuner for ``kernel``'s call ``(*args, **kwargs)``,
    but the heuristic one (which every other test runs), passes ``check(cfg, want)``: ``cfg`` is the op's config
    naming ``impl`` with a forward candidate as ``fwd_params`` and, for a differentiable op, a backward candidate
    as ``bwd_params`` (either ``None``, i.e. the heuristic's, when one stage has more candidates than the other),
    in the implementation's own params classes; ``want`` is ``expected()`` (the reference's result, computed once
    and only when there is a candidate to check). ``check`` runs the call with ``cfg`` and compares it with
    ``want``: the forward, and the gradients when the op is differentiable. A failure names the candidates.

    The candidates come from the implementation itself, for the invocation the executor builds; the forward and
    backward ones are checked in pairs (one compilation each). The CPU tier checks ``CPU_TIER_CANDIDATES`` per
    stage at most, spread over the list; the GPU tier all. Skips when the implementation offers nothing else.
    A suite picks a call small enough for CI yet long enough that the candidates' tiles differ.
    """
    inv = invocation(impl, kernel, args, kwargs)
    chosen: dict[str, list[Any]] = {}
    for stage in ("fwd", "bwd") if differentiable else ("fwd",):
        heuristic = kernel.heuristic_cfg(inv, impl, stage)
        offered = [p for p in dict.fromkeys(impl.candidate_cfgs(inv, stage)) if p is not None and p != heuristic]
        chosen[stage] = offered if tier == "gpu" else _spread(offered, CPU_TIER_CANDIDATES)
    pairs = list(itertools.zip_longest(chosen["fwd"], chosen.get("bwd", [])))
    if not pairs:
        pytest.skip(f"{impl.name} offers no launch configuration besides its heuristic one for {inv.describe()}")
    want = None if expected is None else expected()
    backend = "auto" if impl.backend == "any" else impl.backend
    for fwd_params, bwd_params in pairs:
        cfg = kernel.config_type(platform=impl.name, backend=backend, fwd_params=fwd_params, bwd_params=bwd_params)
        try:
            check(cfg, want)
        except Exception as e:  # a wrong result or a launch that fails: say which candidate
            what = f"fwd_params={fwd_params}" + (f", bwd_params={bwd_params}" if differentiable else "")
            e.add_note(f"{impl.name}, candidate {what} (None: its heuristic's) for {inv.describe()}")
            raise


def skip_if_unsupported(impl: Any, kernel: Any, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """An implementation may decline a call (``supports``); then forcing it must fail with that reason, and the
    test is skipped. ``kernel`` is the op's ``Kernel`` instance, ``fn`` its public function."""
    from ejkernel.ops import ConfigError

    reason = impl.supports(invocation(impl, kernel, args, kwargs))
    if reason is not None:
        with pytest.raises(ConfigError, match="cannot serve"):
            call_forced(fn, impl, *args, **kwargs)
        pytest.skip(f"{impl.name} declines this call: {reason}")
