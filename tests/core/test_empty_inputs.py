"""Zero-size inputs (an idle serving step, an empty batch, no keys) and NumPy inputs.

A call with nothing to compute gives the empty or all-zero result of the contract's shape and dtype (a row that
admits no key gives zeros), under ``jit`` too, with zero gradients, whichever implementation is forced; where
the contract forbids the size, the error names the argument. NumPy caches work in the paged ops.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from ejkernel import modules
from ejkernel.kernels import kernel_registry
from ejkernel.modules.operations.configs import PageAttentionConfig, RaggedPageAttentionConfig
from ejkernel.ops.utils.datacarrier import FwdParams
from ejkernel.testing import reference

SERVING = ("page_attention", "ragged_page_attention", "ragged_decode_attention")
F32, BF16 = "float32", "bfloat16"


@dataclasses.dataclass
class Case:
    """``modules.<op>(**floats, **ints, **options)``; ``floats`` are shapes (random inputs, differentiated),
    ``ints`` values; ``want`` the ``(shape, dtype)`` of every array in the result, all zeros."""

    name: str
    op: str
    floats: dict[str, tuple[int, ...]]
    ints: dict[str, Any]
    options: dict[str, Any]
    want: list[tuple[tuple[int, ...], str]]
    dtype: str = F32

    def inputs(self) -> dict[str, jax.Array]:
        rng = np.random.default_rng(0)
        return {k: jnp.asarray(rng.standard_normal(s, dtype=np.float32), self.dtype) for k, s in self.floats.items()}

    def fn(self, platform: str | None = None) -> Any:
        ints = {k: np.asarray(v, np.int32) if isinstance(v, list) else v for k, v in self.ints.items()}
        return lambda floats: getattr(modules, self.op)(**floats, **ints, **self.options, platform=platform)


def attn(name: str, op: str, b: int, t: int, s: int, dtype: str = F32, dv: int = 16, **options: Any) -> Case:
    qkv = {"query": (b, t, 4, 8), "key": (b, s, 2, 8), "value": (b, s, 2, dv)}
    return Case(name, op, qkv, {}, options, [((b, t, 4, dv), dtype)], dtype)


def linear(name: str, op: str, b: int, h: int = 2, gates: tuple[str, ...] = (), **extra: Any) -> Case:
    shapes = {"q": (b, 3, h, 4), "k": (b, 3, h, 4), "v": (b, 3, h, 5)}
    gate_shapes = {"g": (b, 3, h, 4) if op == "gla" else (b, 3, h), "beta": (b, 3, h), "slope": (h,)}
    shapes.update({g: gate_shapes[g] for g in gates})
    n = b if "cu_seqlens" not in extra else len(extra["cu_seqlens"]) - 1
    want = [((b, 3, h, 5), F32), ((n, h, 4, 5), F32)]
    return Case(name, op, shapes, extra, {"output_final_state": True}, want)


def paged(name: str, n: int) -> Case:
    floats = {"query": (n, 4, 8), "key_cache": (4, 4, 2, 8), "value_cache": (4, 4, 2, 6)}
    ints = {"context_lens": [3] * n, "block_tables": np.zeros((n, 2), np.int32)}
    return Case(name, "page_attention", floats, ints, {}, [((n, 4, 6), F32)])


def ragged_paged(name: str, t: int, s: int) -> Case:
    floats = {"query": (t, 4, 8), "key_cache": (4, 4, 2, 8), "value_cache": (4, 4, 2, 6)}
    cu = list(np.minimum(np.arange(s + 1), t))
    ints = {
        "kv_lens": [3] * s,
        "block_tables": np.zeros((s, 2), np.int32),
        "cu_q_lens": cu,
        "num_seqs": [s],
    }
    return Case(name, "ragged_page_attention", floats, ints, {}, [((t, 4, 6), F32)])


def ragged_decode(name: str, b: int, s: int) -> Case:
    floats = {"query": (b, 4, 8), "key": (b, s, 2, 8), "value": (b, s, 2, 6)}
    ints = {"sequence_start": [0] * b, "sequence_end": [s] * b}
    return Case(name, "ragged_decode_attention", floats, ints, {}, [((b, 4, 6), F32)])


def mla(name: str, b: int, t: int, s: int | None = None, maxp: int = 2) -> Case:
    if s is not None:  # dense
        return Case(name, "multi_head_latent_attention", {"query": (b, t, 4, 12), "kv": (b, s, 12)}, {},
                    {"latent_dim": 8}, [((b, t, 4, 8), F32)])  # fmt: skip
    ints = {"block_tables": np.zeros((b, maxp), np.int32), "cache_seqlens": [0 if maxp == 0 else 3] * b}
    return Case(name, "multi_head_latent_attention", {"query": (b, t, 4, 12), "kv": (4, 4, 12)}, ints,
                {"latent_dim": 8}, [((b, t, 4, 8), F32)])  # fmt: skip


def gmm(name: str, m: int, k: int, n: int, dtype: str = F32, **options: Any) -> Case:
    out = str(np.dtype(options.get("preferred_element_type", dtype)))
    ints = {"group_sizes": [m // 2, m - m // 2]}
    return Case(name, "grouped_matmul", {"lhs": (m, k), "rhs": (2, k, n)}, ints, options, [((m, n), out)], dtype)


def nsa(name: str, b: int) -> Case:
    floats = {"query": (b, 3, 4, 8), "key": (b, 4, 2, 8), "value": (b, 4, 2, 8)}
    ints = {"block_indices": np.zeros((b, 3, 2, 1), np.int32)}
    return Case(name, "native_sparse_attention", floats, ints, {"block_size": 2}, [((b, 3, 4, 8), F32)])


CASES = [
    attn("flash-S0", "flash_attention", 2, 3, 0),
    attn("flash-S0-causal-window", "flash_attention", 2, 3, 0, causal=True, sliding_window=2),
    attn("flash-T0", "flash_attention", 2, 0, 5),
    attn("flash-B0-bf16", "flash_attention", 0, 3, 5, BF16),
    Case(
        "flash-S0-segments",
        "flash_attention",
        {"query": (2, 3, 4, 8), "key": (2, 0, 2, 8), "value": (2, 0, 2, 8)},
        {"q_segment_ids": np.zeros((2, 3), np.int32), "kv_segment_ids": np.zeros((2, 0), np.int32)},
        {},
        [((2, 3, 4, 8), F32)],
    ),
    Case(
        "flash-S0-packed",
        "flash_attention",
        {"query": (1, 3, 4, 8), "key": (1, 0, 2, 8), "value": (1, 0, 2, 8)},
        {"cu_seqlens_q": [0, 3], "cu_seqlens_k": [0, 0]},
        {},
        [((1, 3, 4, 8), F32)],
    ),
    attn("attention-S0", "attention", 2, 3, 0),
    attn("attention-T0", "attention", 2, 0, 5),
    Case(
        "attention-S0-bias-weights-bf16",
        "attention",
        {"query": (2, 3, 4, 8), "key": (2, 0, 2, 8), "value": (2, 0, 2, 8), "bias": (2, 4, 3, 0)},
        {},
        {"return_weights": True},
        [((2, 3, 4, 8), BF16), ((2, 4, 3, 0), F32)],  # the weights are float32 whatever the inputs
        BF16,
    ),
    attn("sdpa-S0", "scaled_dot_product_attention", 2, 3, 0),
    attn("sdpa-T0", "scaled_dot_product_attention", 2, 0, 5),
    attn("ring-S0", "ring_attention", 2, 3, 0),
    attn("ring-T0", "ring_attention", 2, 0, 5),
    attn("ring-B0", "ring_attention", 0, 3, 5, causal=True),
    attn("block_sparse-B0", "block_sparse_attention", 0, 3, 5),
    nsa("native_sparse-B0", 0),
    mla("mla-S0", 2, 3, s=0),
    mla("mla-T0", 2, 0, s=4),
    mla("mla-B0", 0, 3, s=4),
    mla("mla-paged-B0", 0, 1),
    mla("mla-paged-T0", 2, 0),
    mla("mla-paged-no-columns", 2, 1, maxp=0),
    paged("page-N0", 0),
    ragged_paged("ragged_page-T0", 0, 2),
    ragged_paged("ragged_page-no-sequences", 3, 0),
    ragged_decode("ragged_decode-B0", 0, 4),
    ragged_decode("ragged_decode-S0", 2, 0),
    linear("gla-B0", "gla", 0, gates=("g",)),
    linear("gla-H0-packed", "gla", 1, h=0, gates=("g",), cu_seqlens=np.array([0, 1, 3], np.int32)),
    linear("lightning-B0", "lightning_attn", 0, gates=("slope",)),
    linear("recurrent-B0", "recurrent", 0),
    linear("gated_delta_rule-B0", "gated_delta_rule", 0, gates=("g", "beta")),
    gmm("grouped_matmul-M0", 0, 8, 5),
    gmm("grouped_matmul-K0-bf16-to-f32", 4, 0, 5, BF16, preferred_element_type=jnp.float32),
    gmm("grouped_matmul-N0", 4, 8, 0),
    Case("mean_pooling-B0", "mean_pooling", {"x": (0, 3, 4)}, {}, {}, [((0, 4), F32)]),
    Case("mean_pooling-T0", "mean_pooling", {"x": (2, 0, 4)}, {}, {}, [((2, 4), F32)]),
    Case("mean_pooling-packed-T0", "mean_pooling", {"x": (1, 0, 4)}, {"cu_seqlens": [0, 0]}, {}, [((1, 4), F32)]),
]


def _platforms(op: str) -> list[str]:
    """Every implementation registered for the CPU here (xla; triton/pallas in their interpreters when enabled)."""
    return [i.name for i in kernel_registry.implementations(op, backend="cpu")]


def _check_zeros(out: Any, want: list[tuple[tuple[int, ...], str]]) -> None:
    leaves = jax.tree.leaves(out)
    assert [(x.shape, str(x.dtype)) for x in leaves] == want
    for x in leaves:
        assert not np.any(np.asarray(x, np.float32)), "an empty call must give zeros"


@pytest.mark.parametrize(
    ("case", "platform"),
    [pytest.param(c, p, id=f"{c.name}-{p}") for c in CASES for p in [None, *_platforms(c.op)]],
)
def test_empty_call_gives_zeros_of_the_contract_shape(case, platform):
    fn, inputs = case.fn(platform), case.inputs()
    _check_zeros(fn(inputs), case.want)
    _check_zeros(jax.jit(fn)(inputs), case.want)


@pytest.mark.parametrize("case", [c for c in CASES if c.op not in SERVING], ids=lambda c: c.name)
def test_empty_call_has_zero_gradients(case):
    fn, inputs = case.fn(), case.inputs()

    def loss(floats: dict[str, jax.Array]) -> jax.Array:
        return sum((jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(fn(floats))), jnp.float32(0))

    grads = jax.jit(jax.grad(loss))(inputs)
    for name, x in inputs.items():
        assert grads[name].shape == x.shape and grads[name].dtype == x.dtype, name
        assert not np.any(np.asarray(grads[name], np.float32)), name


@pytest.mark.parametrize("case", [c for c in CASES if c.op in SERVING], ids=lambda c: c.name)
def test_empty_serving_call_is_still_not_differentiable(case):
    fn, inputs = case.fn(), case.inputs()
    with pytest.raises(TypeError, match="not differentiable"):
        jax.grad(lambda f: jnp.sum(fn(f)))(inputs)


def _zeros(*shape: int) -> jax.Array:
    return jnp.zeros(shape, jnp.float32)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: modules.block_sparse_attention(_zeros(1, 4, 2, 8), _zeros(1, 0, 2, 8), _zeros(1, 0, 2, 8)),
            "T=4, S=0",
        ),
        (
            lambda: modules.native_sparse_attention(
                _zeros(1, 0, 2, 8), _zeros(1, 4, 2, 8), _zeros(1, 4, 2, 8), jnp.zeros((1, 0, 2, 1), jnp.int32)
            ),
            "T=0, S=4",
        ),
        (
            lambda: modules.grouped_matmul(_zeros(4, 8), _zeros(0, 8, 5), jnp.zeros((0,), jnp.int32)),
            "at least one group",
        ),
        (lambda: modules.gla(*(_zeros(1, 0, 2, 4),) * 4), "T must be at least 1"),
        (lambda: modules.flash_attention(_zeros(1, 4, 2, 0), _zeros(1, 4, 2, 0), _zeros(1, 4, 2, 8)), "head dim D"),
        (
            lambda: modules.page_attention(
                _zeros(2, 4, 0),
                _zeros(4, 4, 2, 0),
                _zeros(4, 4, 2, 8),
                jnp.ones((2,), jnp.int32),
                jnp.zeros((2, 1), jnp.int32),
            ),
            "head dim D",
        ),  # fmt: skip
    ],
    ids=["block_sparse-S0", "native_sparse-T0", "grouped_matmul-G0", "gla-T0", "flash-D0", "page-D0"],
)
def test_sizes_the_contract_forbids_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.skipif(
    len(jax.devices()) < 2, reason="needs 2 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8"
)
def test_empty_shards_under_a_mesh():
    """Every shard of a ring over no keys gives zeros (the empty result is taken per shard)."""
    mesh = jax.make_mesh((2,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
    q = jnp.ones((1, 4, 2, 8))
    spec = P(None, "sp")
    out = modules.ring_attention(q, _zeros(1, 0, 2, 8), _zeros(1, 0, 2, 8), axis_name="sp", mesh=mesh,
                                 in_specs=(spec,) * 3, out_specs=spec)  # fmt: skip
    _check_zeros(out, [((1, 4, 2, 8), F32)])


# ---- NumPy caches -------------------------------------------------------------------------------------


def _paged_inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {
        "query": rng.standard_normal((5, 4, 8), dtype=np.float32),
        "key_cache": rng.standard_normal((12, 4, 2, 8), dtype=np.float32),
        "value_cache": rng.standard_normal((12, 4, 2, 8), dtype=np.float32),
        "lens": np.array([3, 9, 0, 12, 5], np.int32),
        "tables": rng.permutation(15).reshape(5, 3).astype(np.int32) % 12,  # 3 pages (12 tokens) each
    }


def _page(x: dict[str, Any], **kw: Any) -> Any:
    return modules.page_attention(x["query"], x["key_cache"], x["value_cache"], x["lens"], x["tables"], **kw)


def _ragged(x: dict[str, Any], **kw: Any) -> Any:
    # Three sequences: a prefill of 3 rows, two decodes; 2 padding rows.
    query = np.concatenate([x["query"], x["query"][:2]])  # 7 rows
    kv, cu, n = np.array([9, 5, 3], np.int32), np.array([0, 3, 4, 5], np.int32), np.array([3], np.int32)
    return modules.ragged_page_attention(query, x["key_cache"], x["value_cache"], kv, x["tables"][:3], cu, n, **kw)


@pytest.mark.parametrize(
    ("op", "call", "cfg"),
    [
        ("page_attention", _page, None),
        # One sequence per chunk: the multi-chunk path, which sorts and gathers the query rows.
        ("page_attention", _page, PageAttentionConfig(fwd_params=FwdParams(q_blocksize=1, kv_blocksize=4))),
        ("ragged_page_attention", _ragged, None),
        ("ragged_page_attention", _ragged, RaggedPageAttentionConfig(fwd_params=FwdParams(q_blocksize=1))),
    ],
    ids=["page", "page-chunks", "ragged_page", "ragged_page-chunks"],
)
def test_numpy_caches(op, call, cfg):
    x = _paged_inputs()
    as_jax = {k: jnp.asarray(v) for k, v in x.items()}
    for platform in _platforms(op):
        if cfg is not None and not platform.startswith("xla"):
            continue  # the launch parameters above are the XLA implementation's
        kw = {"platform": platform, "cfg": cfg}
        want = call(as_jax, **kw)
        np.testing.assert_allclose(call(x, **kw), want, atol=1e-6, err_msg=platform)
        # Under jit, with the NumPy arrays closed over (constants) and the page tables traced.
        traced = jax.jit(lambda t, kw=kw: call({**x, "tables": t}, **kw))(jnp.asarray(x["tables"]))
        np.testing.assert_allclose(traced, want, atol=1e-6, err_msg=platform)
    if op == "page_attention":
        ref = reference.page_attention(*(as_jax[k] for k in ("query", "key_cache", "value_cache", "lens", "tables")))
        np.testing.assert_allclose(call(x), ref, atol=2e-5)
