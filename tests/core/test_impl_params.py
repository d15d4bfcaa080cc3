"""Every implementation's own launch parameters (design §5), for the XLA and Mosaic TPU kernels whose knobs are
not flash-attention block sizes: what each registration names is what its heuristic and its candidates
return, the generic ``FwdParams``/``BwdParams`` of an old ``cfg=`` map where they meant something and are
refused (naming the field) where they did not, values are checked when made, a tuned class survives the
persistent cache; and every registration of every installed plugin resolves (the install check)."""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ejkernel.ops.config.chain as chain_module
from ejkernel.kernels import kernel_registry
from ejkernel.kernels.params import BwdParams, FwdParams, LaunchParams
from ejkernel.modules import GLAConfig, PageAttentionConfig, gla, page_attention
from ejkernel.ops import ConfigError, Invocation, last_selections
from ejkernel.testing import reference

# Each nox session installs the core with one plugin, or none: the cases of a plugin that is absent are left out.
xp: Any = importlib.import_module("ejkernel_xla.params") if importlib.util.find_spec("ejkernel_xla") else None
pp: Any = importlib.import_module("ejkernel_pallas.tpu.params") if importlib.util.find_spec("ejkernel_pallas") else None
needs_xla = pytest.mark.skipif(xp is None, reason="ejkernel-xla is not installed")
needs_pallas = pytest.mark.skipif(pp is None, reason="ejkernel-pallas is not installed")

F32 = jnp.float32


def _s(*shape: int, dtype: Any = F32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


# One call's shapes per op: enough arguments for every heuristic of the op.
LINEAR = {"q": _s(1, 40, 2, 8)}
ARGS = {
    "gla": LINEAR,
    "lightning_attn": LINEAR,
    "recurrent": LINEAR,
    "gated_delta_rule": LINEAR,
    "grouped_matmul": {"lhs": _s(512, 64), "rhs": _s(4, 64, 256), "transpose_rhs": False},
    "page_attention": {
        "query": _s(6, 4, 16),
        "key_cache": _s(40, 8, 2, 16),
        "value_cache": _s(40, 8, 2, 16),
        "block_tables": _s(6, 5, dtype=jnp.int32),
    },
    "ragged_page_attention": {
        "query": _s(64, 4, 16),
        "key_cache": _s(40, 8, 2, 16),
        "value_cache": _s(40, 8, 2, 16),
        "block_tables": _s(4, 5, dtype=jnp.int32),
    },
    "ragged_decode_attention": {"query": _s(6, 4, 16), "key": _s(6, 300, 2, 16), "value": _s(6, 300, 2, 16)},
    "attention": {"query": _s(1, 8, 2, 16), "key": _s(1, 8, 2, 16)},
    "mean_pooling": {"x": _s(2, 8, 16)},
}

# (op, implementation name, fwd class, bwd class, a generic cfg that maps, what it maps to, a refused field)
XLA = [] if xp is None else [
    ("gla", "xla", xp.ChunkParams, xp.ChunkParams, FwdParams(q_blocksize=64), xp.ChunkParams(64), "kv_blocksize"),
    ("lightning_attn", "xla", xp.ChunkParams, xp.ChunkParams, BwdParams(q_blocksize=1), xp.ChunkParams(1), "num_warps"),
    ("recurrent", "xla", xp.ChunkParams, xp.ChunkParams, FwdParams(q_blocksize=16), xp.ChunkParams(16), "num_stages"),
    (
        "gated_delta_rule", "xla", xp.DeltaRuleParams, xp.DeltaRuleParams,
        BwdParams(q_blocksize=5), xp.DeltaRuleParams(chunk_size=5), "kv_blocksize",
    ),
    (
        "grouped_matmul", "xla", xp.TiledGmmParams, xp.TiledGmmParams,
        FwdParams(q_blocksize=32), xp.TiledGmmParams(block_m=32), "kv_blocksize",
    ),
    ("grouped_matmul", "ragged_dot", xp.NoParams, xp.NoParams, FwdParams(), xp.NoParams(), "q_blocksize"),
    (
        "page_attention", "xla", xp.PagedParams, xp.NoParams,
        FwdParams(q_blocksize=1, kv_blocksize=4), xp.PagedParams(keys_per_block=4, seqs_per_chunk=1), "num_warps",
    ),
    (
        "ragged_page_attention", "xla", xp.RaggedPagedParams, xp.NoParams,
        FwdParams(q_blocksize=8, kv_blocksize=16), xp.RaggedPagedParams(rows_per_item=8, keys_per_block=16),
        "num_stages",
    ),
    (
        "ragged_decode_attention", "xla", xp.RaggedDecodeParams, xp.NoParams,
        FwdParams(q_blocksize=2, kv_blocksize=64), xp.RaggedDecodeParams(keys_per_block=64, rows_per_chunk=2),
        "num_warps",
    ),
    ("attention", "xla", xp.NoParams, xp.NoParams, BwdParams(), xp.NoParams(), "q_blocksize"),
    ("mean_pooling", "xla", xp.NoParams, xp.NoParams, FwdParams(), xp.NoParams(), "kv_blocksize"),
]  # fmt: skip
PALLAS = (
    []
    if pp is None
    else [
        (
            "gla", "mosaic_tpu", pp.GlaChunkParams, pp.GlaChunkParams,
            FwdParams(q_blocksize=64), pp.GlaChunkParams(64), "kv_blocksize",
        ),
        (
            "grouped_matmul", "mosaic_tpu", pp.GmmParams, pp.GmmParams,
            BwdParams(q_blocksize=256, kv_blocksize=128), pp.GmmParams(block_m=256, block_n=128), "num_stages",
        ),
        (
            "page_attention", "mosaic_tpu", pp.PagedKeyParams, pp.ForwardOnly,
            FwdParams(kv_blocksize=16), pp.PagedKeyParams(16), "q_blocksize",
        ),
        (
            "ragged_decode_attention", "mosaic_tpu", pp.DecodeKeyParams, pp.ForwardOnly,
            FwdParams(kv_blocksize=40), pp.DecodeKeyParams(40), "q_blocksize",
        ),
        (
            "ragged_page_attention", "mosaic_tpu", pp.RaggedItemParams, pp.ForwardOnly,
            FwdParams(q_blocksize=5, kv_blocksize=12), pp.RaggedItemParams(rows_per_item=5, keys_per_block=12),
            "num_warps",
        ),
    ]
)  # fmt: skip
PORTED = XLA + PALLAS
IDS = [f"{op}-{name}" for op, name, *_ in PORTED]


def _impl(op: str, name: str) -> Any:
    found = [i for i in kernel_registry.implementations(op, backend="all") if i.name == name]
    assert len(found) == 1, f"{op}: no single implementation named {name!r}"
    return found[0]


def _inv(op: str, backend: str) -> Invocation:
    return Invocation.create(op, ARGS[op], "tpu" if backend == "tpu" else "cpu")


@pytest.mark.parametrize(("op", "name", "fwd_cls", "bwd_cls", "generic", "mapped", "refused"), PORTED, ids=IDS)
def test_the_registration_names_the_classes_its_heuristic_and_candidates_return(
    op, name, fwd_cls, bwd_cls, generic, mapped, refused
):
    impl = _impl(op, name)
    inv = _inv(op, impl.backend)
    for stage, cls in (("fwd", fwd_cls), ("bwd", bwd_cls)):
        assert impl.params_type(stage) is cls
        heuristic = impl.heuristic_cfg(inv, stage)
        if impl.heuristic_fn is None:  # no heuristic: nothing to choose (the class has no field)
            assert heuristic is None and not dataclasses.fields(cls)
            continue
        assert type(heuristic) is cls, f"{op} {name} {stage}: the heuristic gave {heuristic!r}"
        candidates = impl.candidate_cfgs(inv, stage)
        assert candidates and all(type(c) is cls for c in candidates), f"{op} {name} {stage}: {candidates}"
        assert all(cls.from_dict(c.to_dict()) == c for c in candidates)  # what the caches store and restore


@pytest.mark.parametrize(("op", "name", "fwd_cls", "bwd_cls", "generic", "mapped", "refused"), PORTED, ids=IDS)
def test_an_old_generic_cfg_maps_or_is_refused_naming_the_field(op, name, fwd_cls, bwd_cls, generic, mapped, refused):
    impl = _impl(op, name)
    stage = "fwd" if type(mapped) is fwd_cls else "bwd"
    assert impl.coerce_params(generic, stage) == mapped
    bad = FwdParams(**{refused: 8}) if stage == "fwd" else BwdParams(**{refused: 8})
    cls = impl.params_type(stage)
    with pytest.raises(ValueError, match=rf"{cls.__name__} has no field for \['{refused}'\]"):
        impl.coerce_params(bad, stage)


def test_a_field_the_kernel_does_not_use_does_not_exist():
    fields = {c.__name__: [f.name for f in dataclasses.fields(c)] for _, _, fwd, bwd, *_ in PORTED for c in (fwd, bwd)}
    want: dict[str, list[str]] = {}
    if xp is not None:
        want |= {
            "ChunkParams": ["chunk_size"],
            "DeltaRuleParams": ["chunk_size"],
            "TiledGmmParams": ["block_m"],
            "NoParams": [],
            "PagedParams": ["keys_per_block", "seqs_per_chunk"],
            "RaggedPagedParams": ["rows_per_item", "keys_per_block"],
            "RaggedDecodeParams": ["keys_per_block", "rows_per_chunk"],
        }
    if pp is not None:
        want |= {
            "GlaChunkParams": ["chunk_size"],
            "GmmParams": ["block_m", "block_n"],
            "PagedKeyParams": ["keys_per_block"],
            "DecodeKeyParams": ["keys_per_block"],
            "RaggedItemParams": ["rows_per_item", "keys_per_block"],
            "ForwardOnly": [],
        }
    assert fields == want


def _xla(make: Any, message: str) -> Any:
    return pytest.param(make, message, marks=needs_xla)


def _pallas(make: Any, message: str) -> Any:
    return pytest.param(make, message, marks=needs_pallas)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        _xla(lambda: xp.ChunkParams(chunk_size=48), r"ChunkParams\.chunk_size must be a power of two"),
        _xla(lambda: xp.ChunkParams(chunk_size=0), r"ChunkParams\.chunk_size must be a power of two"),
        _xla(lambda: xp.ChunkParams.from_generic(FwdParams(q_blocksize=3)), r"ChunkParams\.chunk_size must be a power"),
        _xla(lambda: xp.DeltaRuleParams(chunk_size=-1), r"DeltaRuleParams\.chunk_size must be a positive int"),
        _xla(lambda: xp.TiledGmmParams(block_m=True), r"TiledGmmParams\.block_m must be a positive int"),
        _xla(lambda: xp.PagedParams(seqs_per_chunk=2.0), r"PagedParams\.seqs_per_chunk must be a positive int"),
        _xla(lambda: xp.RaggedPagedParams(keys_per_block=0), r"RaggedPagedParams\.keys_per_block must be"),
        _xla(lambda: xp.RaggedDecodeParams(rows_per_chunk=0), r"RaggedDecodeParams\.rows_per_chunk must be"),
        _pallas(
            lambda: pp.GlaChunkParams(chunk_size=256), r"GlaChunkParams\.chunk_size must be a power of two from 16"
        ),
        _pallas(lambda: pp.GlaChunkParams.from_generic(BwdParams(q_blocksize=8)), r"GlaChunkParams\.chunk_size must"),
        _pallas(lambda: pp.GmmParams(block_n=0), r"GmmParams\.block_n must be a positive"),
        _pallas(lambda: pp.PagedKeyParams(-8), r"PagedKeyParams\.keys_per_block must be"),
        _pallas(lambda: pp.DecodeKeyParams(0), r"DecodeKeyParams\.keys_per_block must be"),
        _pallas(lambda: pp.RaggedItemParams(rows_per_item=0), r"RaggedItemParams\.rows_per_item must be"),
    ],
)
def test_values_are_checked_when_made(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def _gla_inputs(t: int = 8) -> tuple[jax.Array, ...]:
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.standard_normal((1, t, 2, 8)), F32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((1, t, 2, 4)), F32)
    g = jax.nn.log_sigmoid(jnp.asarray(rng.standard_normal((1, t, 2, 8)), F32)) / 16
    return q, k, v, g


@needs_xla
def test_an_old_generic_cfg_keeps_working_through_the_public_function():
    args = _gla_inputs(40)
    want, _ = reference.gla(*args)
    out, _ = gla(*args, cfg=GLAConfig(platform="xla", fwd_params=FwdParams(q_blocksize=16)))
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
    sel = last_selections()[-1]
    assert (sel.tier, sel.params) == ("override", xp.ChunkParams(chunk_size=16))  # the kernel gets its own class
    with pytest.raises(ConfigError, match=r"ChunkParams has no field for \['kv_blocksize'\]"):
        gla(*args, cfg=GLAConfig(platform="xla", fwd_params=FwdParams(q_blocksize=16, kv_blocksize=64)))
    with pytest.raises(ConfigError, match=r"ChunkParams\.chunk_size must be a power of two"):
        gla(*args, cfg=GLAConfig(platform="xla", fwd_params=FwdParams(q_blocksize=48)))


@needs_xla
def test_params_of_its_own_class_reach_the_kernel_and_a_forward_only_op_takes_no_backward_params():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((3, 4, 16)), F32)
    cache = jnp.asarray(rng.standard_normal((8, 4, 2, 16)), F32)
    args = (q, cache, cache, jnp.asarray([10, 5, 12]), jnp.asarray([[0, 1, 2], [3, 4, 0], [5, 6, 7]]))
    own = PageAttentionConfig(platform="xla", fwd_params=xp.PagedParams(keys_per_block=4, seqs_per_chunk=2))
    np.testing.assert_allclose(page_attention(*args, cfg=own), reference.page_attention(*args), rtol=1e-5, atol=1e-5)
    assert last_selections()[-1].params == own.fwd_params
    impl = _impl("page_attention", "xla")
    assert impl.coerce_params(BwdParams(), "bwd") == xp.NoParams()
    with pytest.raises(ValueError, match=r"NoParams has no field for \['kv_blocksize'\]"):
        impl.coerce_params(BwdParams(kv_blocksize=8), "bwd")


@needs_xla
def test_a_tuned_class_of_its_own_survives_the_persistent_cache(monkeypatch):
    args = _gla_inputs(8)  # T = 8: the chunk sizes 1 and 8 to time
    monkeypatch.setenv("EJKERNEL_AUTOTUNE_POLICY", "autotune")
    gla(*args, platform="xla")
    sel = last_selections()[-1]
    assert sel.tier == "autotune" and type(sel.params) is xp.ChunkParams
    tuned = sel.params
    monkeypatch.setattr(chain_module, "_default_chain", None)  # a new process: an empty memory cache, the same disk
    out, _ = gla(*args, platform="xla")
    sel = last_selections()[-1]
    assert sel.tier == "persistent" and type(sel.params) is xp.ChunkParams and sel.params == tuned
    np.testing.assert_allclose(out, reference.gla(*args)[0], rtol=2e-5, atol=2e-5)


def test_every_registration_resolves():
    """The install check: every lazy reference (function, supports, heuristic, candidates, params classes) of
    every registration of every installed plugin imports, on a CPU, GPU-only and TPU-only ones included."""
    seen: dict[str, int] = {}
    for op in kernel_registry.algorithms():
        for impl in kernel_registry.implementations(op, backend="all"):
            impl.resolve()
            for stage in ("fwd", "bwd"):
                assert issubclass(impl.params_type(stage), LaunchParams)
            seen[impl.platform] = seen.get(impl.platform, 0) + 1
    if xp is not None:
        assert seen.get("xla", 0) >= 18
    if pp is not None:
        assert seen.get("pallas", 0) >= 9
