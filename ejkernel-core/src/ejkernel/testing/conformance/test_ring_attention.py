"""Conformance suite of ``ring_attention``: every installed implementation against ``flash_attention``'s reference
on the gathered sequence.

Layout: B batch, T/S local query/key length per device, H query heads, K kv heads, D head dim, Dv value dim.
The ring cases run on ``N`` devices of a one-axis mesh ``("sp",)``: the global sequence (N*T queries,
N*S keys) is laid out (``ring_attention_layout``), sharded along the sequence, attended, and the
output and gradients are laid back and compared with the dense reference of the whole sequence. They
need at least ``N`` devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8`` on a CPU).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

from ejkernel.modules import ring_attention, ring_attention_layout
from ejkernel.modules.operations.ring_attention import _kernel
from ejkernel.testing import reference
from ejkernel.testing.conformance._harness import (
    FWD_RTOL,
    GRAD_RTOL,
    assert_close,
    call_forced,
    check_candidate_configs,
    fresh_key,
    implementations_under_test,
)
from ejkernel.testing.conformance._harness import skip_if_unsupported as _skip_if_unsupported

OP = "ring_attention"
N = 4  # devices on the ring
AXIS = "sp"

needs_ring = pytest.mark.skipif(
    len(jax.devices()) < N,
    reason=f"the ring cases need >= {N} devices: run with XLA_FLAGS=--xla_force_host_platform_device_count=8",
)


def pytest_generate_tests(metafunc: Any) -> None:
    if "impl" in metafunc.fixturenames:
        metafunc.parametrize("impl", implementations_under_test(metafunc.config, OP))


def ring_mesh(n: int = N) -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array(jax.devices()[:n]), (AXIS,))


@dataclasses.dataclass(frozen=True)
class Case:
    """A ring call: local lengths ``t``/``s`` per device, a layout, options."""

    name: str
    layout: str = "contiguous"
    b: int = 2
    t: int = 8
    s: int = 8
    h: int = 4
    k: int = 2
    d: int = 16
    dv: int | None = None
    options: tuple[tuple[str, Any], ...] = ()
    segments: bool = False


CAUSAL = (("causal", True),)
# Each case compiles a ring (forward and backward), so options are combined to keep the suite short.
CASES = [
    Case("contiguous_gqa_window_asymmetric", options=(("sliding_window", (3, 9)),)),
    Case("contiguous_causal_t_lt_s", t=6, s=10, options=CAUSAL),
    # The first global rows see no key: zeros there.
    Case("zigzag_causal_t_gt_s", layout="zigzag", t=10, s=6, options=CAUSAL),
    Case("zigzag_window_causal_segments", layout="zigzag", segments=True,
         options=(("sliding_window", (5, 0)), ("causal", True))),
    Case("striped_causal_soft_cap_scale_mqa", layout="striped", k=1,
         options=(("causal", True), ("logits_soft_cap", 2.0), ("softmax_scale", 0.7))),
    Case("contiguous_segments_causal", t=12, s=12, segments=True, options=CAUSAL),
    Case("striped_dv_differs_window", layout="striped", dv=24, options=(("sliding_window", 6),)),
    Case("length_one_batch_one", b=1, t=1, s=1, options=CAUSAL),
]  # fmt: skip
# bfloat16/float16 on one case each (the float32 cases cover the options).
LOW_PRECISION = {"bfloat16": "zigzag_window_causal_segments", "float16": "contiguous_segments_causal"}
DTYPE_CASES = [(c, "float32") for c in CASES] + [
    (c, dt) for dt, name in LOW_PRECISION.items() for c in CASES if c.name == name
]
# The GPU tier's realistic shapes (on 4 GPUs): 1028 to 2056 tokens over the ring (257 to 514 per device, even under
# zigzag, which halves them), head dim 128, GQA.
GPU_CASES = [
    Case("gpu_contiguous_gqa_causal", b=2, t=257, s=257, h=8, k=2, d=128, options=CAUSAL),
    Case("gpu_zigzag_window_segments", layout="zigzag", b=2, t=258, s=514, h=8, k=2, d=128, segments=True,
         options=(("sliding_window", (256, 0)), ("causal", True))),
    Case("gpu_striped_soft_cap_mqa", layout="striped", b=2, t=257, s=257, h=8, k=1, d=128,
         options=(("causal", True), ("logits_soft_cap", 30.0))),
]  # fmt: skip
GPU_DTYPE_CASES = [(c, d) for c in GPU_CASES for d in ("bfloat16", "float32")]


def make_global(case: Case, dtype: str, seed: int, n: int = N) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Whole-sequence inputs in natural order: ``(q, k, v)`` and the segment ids (if any).

    NumPy draws them (``jax.random`` would compile a sampler for every shape, seconds per case on a CPU).
    """
    rng = np.random.default_rng(seed)
    t, s, dv = n * case.t, n * case.s, case.dv or case.d

    def normal(*shape: int) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape, np.float32), dtype)

    q, k, v = normal(case.b, t, case.h, case.d), normal(case.b, s, case.k, case.d), normal(case.b, s, case.k, dv)
    arrays: dict[str, Any] = {}
    if case.segments:
        qs = np.sort(rng.integers(0, 3, (case.b, t)), axis=-1)
        qs[:, -1] = 7  # segment 7 has no key: a zero row
        arrays["q_segment_ids"] = jnp.asarray(qs, jnp.int32)
        arrays["kv_segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, (case.b, s)), axis=-1), jnp.int32)
    return (q, k, v), arrays


def ring_call(impl: Any, case: Case, n: int = N, cfg: Any = None) -> Any:
    """``f(q, k, v, arrays)`` on laid-out global arrays: ``ring_attention`` sharded over a ring of ``n`` (with
    ``cfg``: that launch configuration)."""
    mesh = ring_mesh(n)
    options = dict(case.options)

    def f(q: Any, k: Any, v: Any, arrays: dict[str, Any]) -> Any:
        specs = {name: P(None, AXIS) for name in ("query", "key", "value", *arrays)}
        return call_forced(
            ring_attention, impl, q, k, v, **arrays, **options, axis_name=AXIS, layout=case.layout,
            cfg=cfg, mesh=mesh, in_specs=specs, out_specs=P(None, AXIS),
        )  # fmt: skip

    return f


def value_and_grads(fn: Any, args: tuple[Any, ...], arrays: dict[str, Any], cot: Any, layout: str | None = None,
                    n: int = N) -> tuple[Any, Any]:  # fmt: skip
    """``fn(q, k, v, arrays)`` and the gradients of ``sum(out * cot)`` in q, k, v: one compiled call.

    With ``layout``, ``fn`` takes laid-out arrays: the natural-order inputs are laid out, and the output
    and gradients laid back, inside the compiled call.
    """

    def run(args: Any, arrays: Any, cot: Any) -> Any:
        if layout is not None:
            args, arrays, cot = layout_all((args, arrays, cot), layout, n=n)
        out, vjp = jax.vjp(lambda *a: fn(*a, arrays), *args)
        result = (out, vjp(cot.astype(out.dtype)))
        return result if layout is None else layout_all(result, layout, inverse=True, n=n)

    return jax.jit(run)(args, arrays, cot)


def dense(args: tuple[Any, ...], **options: Any) -> Any:
    """The flash reference on the whole sequence (compiled: op by op it is slower)."""
    arrays = {k: v for k, v in options.items() if isinstance(v, jax.Array)}
    static = {k: v for k, v in options.items() if k not in arrays}
    return jax.jit(lambda a, arr: reference.flash_attention(a[0], a[1], a[2], **arr, **static))(args, arrays)


def layout_all(x: Any, layout: str, inverse: bool = False, n: int = N) -> Any:
    return jax.tree.map(lambda a: ring_attention_layout(a, n, layout, inverse=inverse), x)


def _cot(case: Case, seed: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed + 1).standard_normal((case.b, N * case.t, case.h, case.dv or case.d)))


def _assert_matches(got: Any, want: Any, case: Case, dtype: str, seed: int) -> None:
    (out, grads), (want_out, want_grads) = got, want
    assert out.dtype == jnp.dtype(dtype), f"output dtype {out.dtype} != input dtype {dtype}"
    assert_close(out, want_out, FWD_RTOL[dtype], f"{case.name} forward", seed)
    for name, g, w in zip(("dq", "dk", "dv"), grads, want_grads):
        assert g.dtype == w.dtype, f"{name} dtype {g.dtype} != {w.dtype}"
        assert_close(g, w, GRAD_RTOL[dtype], f"{case.name} {name}", seed)


def _dense_value_and_grads(case: Case, args: tuple[Any, ...], arrays: dict[str, Any], cot: jax.Array) -> Any:
    options = dict(case.options)
    return value_and_grads(lambda q, k, v, arr: reference.flash_attention(q, k, v, **arr, **options), args, arrays, cot)


@needs_ring
@pytest.mark.parametrize(("case", "dtype"), DTYPE_CASES, ids=[f"{c.name}-{dt}" for c, dt in DTYPE_CASES])
def test_ring_matches_flash_attention_on_the_gathered_sequence(impl, case, dtype):
    _, seed = fresh_key()
    args, arrays = make_global(case, dtype, seed)
    cot = _cot(case, seed)
    out, grads = value_and_grads(ring_call(impl, case), args, arrays, cot, case.layout)
    want = _dense_value_and_grads(case, args, arrays, cot)
    _assert_matches((out, grads), want, case, dtype, seed)
    if case.segments or case.name == "zigzag_causal_t_gt_s":
        rows = np.asarray(want[0], np.float32) == 0
        assert rows.any(), "the case must have rows that see no key"
        assert np.all(np.asarray(out, np.float32)[rows] == 0), "rows without keys must be exactly zero"


@needs_ring
@pytest.mark.parametrize(("case", "dtype"), GPU_DTYPE_CASES, ids=[f"{c.name}-{dt}" for c, dt in GPU_DTYPE_CASES])
def test_gpu_tier_ring_matches_flash_attention_on_the_gathered_sequence(impl, case, dtype, gpu_tier):
    _, seed = fresh_key()
    args, arrays = make_global(case, dtype, seed)
    cot = _cot(case, seed)
    got = value_and_grads(ring_call(impl, case), args, arrays, cot, case.layout)
    _assert_matches(got, _dense_value_and_grads(case, args, arrays, cot), case, dtype, seed)


@needs_ring
def test_every_candidate_config_matches_reference(impl, tier):
    """Each launch configuration the implementation offers the autotuner: local lengths of several tiles of each,
    the last one partial."""
    case = Case("candidates", t=37, s=45, segments=True, options=CAUSAL)
    _, seed = fresh_key()
    args, arrays = make_global(case, "float32", seed)
    cot = _cot(case, seed)
    # The call each device makes: local lengths, over the ring's axis.
    local = {n: jax.ShapeDtypeStruct((x.shape[0], x.shape[1] // N, *x.shape[2:]), x.dtype) for n, x in arrays.items()}
    q, k, v = (jax.ShapeDtypeStruct((x.shape[0], x.shape[1] // N, *x.shape[2:]), x.dtype) for x in args)
    options = {**local, **dict(case.options), "axis_name": AXIS, "layout": case.layout}

    def check(cfg, want):
        got = value_and_grads(ring_call(impl, case, cfg=cfg), args, arrays, cot, case.layout)
        _assert_matches(got, want, case, "float32", seed)

    expected = lambda: _dense_value_and_grads(case, args, arrays, cot)  # noqa: E731
    check_candidate_configs(impl, _kernel, (q, k, v), options, check, tier=tier, expected=expected)


@needs_ring
def test_check_grads_numerically(impl):
    case = Case("tiny", layout="zigzag", b=1, t=2, s=2, h=2, k=1, d=8, options=(("causal", True), ("logits_soft_cap", 3.0)))  # fmt: skip
    _, seed = fresh_key()
    args, _ = make_global(case, "float32", seed)
    f = ring_call(impl, case)
    with jax.enable_x64(False):
        check_grads(jax.jit(lambda q, k, v: f(q, k, v, {})), layout_all(args, case.layout), order=1, modes=("rev",),
                    atol=3e-2, rtol=3e-2, eps=1e-2)  # fmt: skip


@needs_ring
def test_inside_a_users_shard_map_on_a_two_axis_mesh(impl):
    """Batch over ``dp``, the sequence over ``sp``: the ring runs along ``sp`` only."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", AXIS))
    case = Case("user", layout="zigzag", b=4, options=CAUSAL)
    _, seed = fresh_key()
    args, _ = make_global(case, "float32", seed, n=2)
    spec = P("dp", AXIS)
    backend = None if impl.backend == "any" else impl.backend

    def body(q: Any, k: Any, v: Any) -> Any:
        return ring_attention(q, k, v, causal=True, axis_name=AXIS, layout="zigzag", platform=impl.platform,
                              backend=backend)  # fmt: skip

    sharded = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
    out = jax.jit(lambda a: layout_all(sharded(*layout_all(a, "zigzag", n=2)), "zigzag", inverse=True, n=2))(args)
    assert_close(out, dense(args, causal=True), FWD_RTOL["float32"], "user shard_map", seed)


@needs_ring
def test_autotune_policy_serves_a_ring_call(impl, monkeypatch):
    """The autotuner cannot time collectives outside shard_map: under ``autotune`` the call still runs."""
    monkeypatch.setenv("EJKERNEL_AUTOTUNE_POLICY", "autotune")
    case = Case("autotune", layout="striped", options=CAUSAL)
    _, seed = fresh_key()
    args, _ = make_global(case, "float32", seed)
    ring = ring_call(impl, case)
    out = jax.jit(lambda a: layout_all(ring(*layout_all(a, "striped"), {}), "striped", inverse=True))(args)
    assert_close(out, dense(args, causal=True), FWD_RTOL["float32"], "autotune", seed)


@pytest.mark.parametrize(
    "options",
    [{}, {"causal": True, "sliding_window": (4, 1), "layout": "zigzag", "segments": True}],
    ids=["plain", "causal_window_segments_zigzag_ignored"],
)
def test_without_an_axis_it_is_flash_attention_of_the_local_sequence(impl, options):
    _, seed = fresh_key()
    options = dict(options)
    case = Case("local", t=13, s=17, segments=options.pop("segments", False))  # odd: no layout applies
    (q, k, v), arrays = make_global(case, "float32", seed, n=1)
    _skip_if_unsupported(impl, _kernel, ring_attention, (q, k, v), {**arrays, **options})

    def local(q: Any, k: Any, v: Any, arr: dict[str, Any]) -> Any:
        return call_forced(ring_attention, impl, q, k, v, **arr, **options)

    # Under vmap too: a leading axis of 1 mapped over (no axis name: nothing collective to batch).
    out = jax.jit(jax.vmap(local))(q[None], k[None], v[None], {n: a[None] for n, a in arrays.items()})[0]
    options.pop("layout", None)
    assert_close(out, dense((q, k, v), **arrays, **options), FWD_RTOL["float32"], "local", seed)


BAD_INPUTS = [
    ("query_ndim", lambda q, k, v: ((q[0], k, v), {}), "query must be 4-D"),
    ("dtype_mismatch", lambda q, k, v: ((q, k.astype(jnp.bfloat16), v), {}), "must share a dtype"),
    ("int_query", lambda q, k, v: ((q.astype(jnp.int32), k, v), {}), "query must be float32, bfloat16 or float16"),
    ("heads", lambda q, k, v: ((q[:, :, :3], k, v), {}), "multiple of key/value heads"),
    ("head_dim", lambda q, k, v: ((q, k[..., :8], v), {}), "key head dim must equal query head dim"),
    ("window", lambda q, k, v: ((q, k, v), {"sliding_window": (-1, 2)}), "sliding_window must be"),
    ("soft_cap", lambda q, k, v: ((q, k, v), {"logits_soft_cap": 0.0}), "logits_soft_cap must be a positive"),
    (
        "segments_half",
        lambda q, k, v: ((q, k, v), {"q_segment_ids": jnp.zeros((2, 8), jnp.int32)}),
        "pass both q_segment_ids",
    ),
    ("unknown_layout", lambda q, k, v: ((q, k, v), {"layout": "diagonal"}), "layout must be one of"),
    ("axis_name_type", lambda q, k, v: ((q, k, v), {"axis_name": 3}), "axis_name must be a mesh axis name"),
    ("axis_not_bound", lambda q, k, v: ((q, k, v), {"axis_name": "sp"}), "axis_name 'sp' is not bound"),
    ("bias_is_not_an_argument", lambda q, k, v: ((q, k, v, jnp.zeros((2, 4, 8, 8))), {}), "positional argument"),
]


@pytest.mark.parametrize(("name", "make", "message"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_are_refused_with_a_clear_error(impl, name, make, message):
    q = jnp.ones((2, 8, 4, 16))
    k = v = jnp.ones((2, 8, 2, 16))
    args, kwargs = make(q, k, v)
    with pytest.raises((ValueError, TypeError), match=message):
        call_forced(ring_attention, impl, *args, **kwargs)


@needs_ring
@pytest.mark.parametrize(
    ("t", "s", "message"),
    [(7, 8, "local query length T must be even, got 7"), (8, 5, "local key length S must be even, got 5")],
)
def test_zigzag_needs_even_local_lengths(impl, t, s, message):
    q = jnp.ones((1, N * t, 2, 8))
    k = v = jnp.ones((1, N * s, 2, 8))
    spec = P(None, AXIS)
    with pytest.raises(ValueError, match=message):
        call_forced(ring_attention, impl, q, k, v, axis_name=AXIS, layout="zigzag", mesh=ring_mesh(),
                    in_specs=(spec,) * 3, out_specs=spec)  # fmt: skip
