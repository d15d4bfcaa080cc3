"""Core v2's promise, shown with an in-test plugin: a new op, and a second ``page_attention`` with launch
parameters of its own, both registered without a core edit, tuned by the autotuner, persisted and
restored from the on-disk cache; plus the seed API that must keep working."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ejkernel.ops.config.chain as chain_module
from ejkernel.kernels import kernel_registry
from ejkernel.kernels.params import FwdParams, LaunchParams
from ejkernel.modules import PageAttentionConfig, page_attention
from ejkernel.ops import Call, ConfigError, Executor, Kernel, last_selections
from ejkernel.plugins import hookimpl, register_plugin, unregister_plugin
from ejkernel.testing import reference

# -- the plugin ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SplitParams(LaunchParams):
    """A split-K decode's parameters: the field names no generic carrier has."""

    num_splits: int = 1
    pages_per_block: int = 4


@dataclasses.dataclass(frozen=True)
class RepeatParams(LaunchParams):
    repeats: int = 1


def _busy(x: jax.Array, rounds: int) -> jax.Array:
    """``x`` unchanged, after ``rounds`` rounds of real work that XLA cannot drop (its cost is the point)."""
    m = jnp.eye(x.shape[-1], dtype=jnp.float32) * 0.5
    y = jax.lax.fori_loop(0, rounds, lambda i, y: jnp.tanh(y @ m), x.astype(jnp.float32))
    return x + 0 * y.astype(x.dtype)


calls: list[tuple[str, LaunchParams | None]] = []


def split_page_attention(call: Call, *, fwd_params: SplitParams | None, bwd_params: None) -> jax.Array:
    """A second page_attention: the reference, slowed down unless ``num_splits == 2`` (the autotuner must find it)."""
    p = fwd_params or SplitParams()
    calls.append(("page_attention", p))
    out = reference.page_attention(**call.arguments).astype(call.query.dtype)
    return _busy(out, 0 if p.num_splits == 2 else 60)


def split_candidates(inv, stage):  # noqa: ANN001
    return [SplitParams(num_splits=s, pages_per_block=b) for s in (1, 2, 4) for b in (4,)]


def scaled_add_stub(x, y, *, alpha=1.0, fwd_params=None, bwd_params=None):  # noqa: ANN001
    """The new op's contract: ``x + alpha * y``."""


def scaled_add_validate(x, y, *, alpha):  # noqa: ANN001
    if np.shape(x) != np.shape(y):
        raise ValueError(f"scaled_add: x and y must have one shape, got {np.shape(x)} and {np.shape(y)}")


def scaled_add_reference(x, y, *, alpha=1.0):  # noqa: ANN001
    return x + alpha * y


def scaled_add_impl(call: Call, *, fwd_params: RepeatParams | None, bwd_params: None) -> jax.Array:
    p = fwd_params or RepeatParams()
    calls.append(("scaled_add", p))
    return _busy(call.x + call.alpha * call.y, 0 if p.repeats == 3 else 80)


class Plugin:
    @hookimpl
    def ejkernel_register_ops(self, registry):  # noqa: ANN001
        registry.register_op("scaled_add", scaled_add_stub, scaled_add_validate, reference=scaled_add_reference)

    @hookimpl
    def ejkernel_register_kernels(self, registry):  # noqa: ANN001
        registry.register(
            "page_attention",
            "mine",
            "any",
            priority=1000,
            name="mine_splitk",
            impl=split_page_attention,
            takes_call=True,
            options=("softmax_scale",),  # it declines a soft cap or a window
            fwd_params=SplitParams,
            heuristic_cfg=lambda inv, stage: SplitParams() if stage == "fwd" else None,
            candidate_cfgs=split_candidates,
        )
        registry.register(
            "scaled_add",
            "mine",
            "any",
            name="mine_add",
            impl=scaled_add_impl,
            takes_call=True,
            options=("alpha",),
            fwd_params=RepeatParams,
            heuristic_cfg=lambda inv, stage: RepeatParams() if stage == "fwd" else None,
            candidate_cfgs=lambda inv, stage: [RepeatParams(repeats=r) for r in (1, 3, 5)],
        )


class ScaledAdd(Kernel):
    op_id = "scaled_add"


def scaled_add(x, y, *, alpha=1.0, platform=None, cfg=None):  # noqa: ANN001
    """What the plugin would ship as its public function."""
    return Executor()(ScaledAdd(), x, y, alpha=alpha, platform=platform, cfg=cfg)


@pytest.fixture
def plugin():
    calls.clear()
    register_plugin(Plugin(), "core-v2-test")
    yield
    unregister_plugin("core-v2-test")


def _paged_inputs():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((3, 4, 16)), jnp.float32)
    cache = jnp.asarray(rng.standard_normal((8, 4, 2, 16)), jnp.float32)
    tables = jnp.asarray([[0, 1, 2], [3, 4, -1], [5, 6, 7]])
    lens = jnp.asarray([10, 5, 12])
    return q, cache, cache, lens, tables


def _fresh_process(monkeypatch):
    """What a new process sees: an empty memory cache, the same disk."""
    monkeypatch.setattr(chain_module, "_default_chain", None)


# -- the tests -------------------------------------------------------------------------------------


def test_a_second_page_attention_with_its_own_params_is_tuned_persisted_and_restored(plugin, monkeypatch):
    args = _paged_inputs()
    want = reference.page_attention(*args)
    monkeypatch.setenv("EJKERNEL_AUTOTUNE_POLICY", "autotune")
    out = page_attention(*args, platform="mine_splitk")
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    sel = last_selections()[-1]
    assert (sel.impl.name, sel.tier, sel.params) == ("mine_splitk", "autotune", SplitParams(num_splits=2))
    _fresh_process(monkeypatch)
    calls.clear()
    page_attention(*args, platform="mine_splitk")
    sel = last_selections()[-1]
    assert sel.tier == "persistent" and sel.params == SplitParams(num_splits=2)
    assert type(sel.params) is SplitParams and calls == [("page_attention", SplitParams(num_splits=2))]


def test_the_new_op_is_tuned_persisted_and_restored(plugin, monkeypatch):
    x, y = jnp.ones((4, 32)), jnp.arange(128.0).reshape(4, 32)
    monkeypatch.setenv("EJKERNEL_AUTOTUNE_POLICY", "autotune")
    np.testing.assert_allclose(scaled_add(x, y, alpha=2.0), x + 2 * y)
    sel = last_selections()[-1]
    assert (sel.op, sel.impl.name, sel.tier, sel.params) == ("scaled_add", "mine_add", "autotune", RepeatParams(3))
    _fresh_process(monkeypatch)
    np.testing.assert_allclose(jax.jit(lambda a, b: scaled_add(a, b, alpha=2.0))(x, y), x + 2 * y)
    assert (last_selections()[-1].tier, last_selections()[-1].params) == ("persistent", RepeatParams(3))
    with pytest.raises(ValueError, match="scaled_add: x and y must have one shape"):
        scaled_add(x, y[:, :3])
    assert "scaled_add" in kernel_registry.algorithms()


def test_the_new_op_goes_with_its_plugin():
    register_plugin(Plugin(), "core-v2-test")
    unregister_plugin("core-v2-test")
    from ejkernel.kernels.signatures import OPS

    assert "scaled_add" not in OPS


def test_an_option_the_implementation_does_not_know_declines_it(plugin):
    args = _paged_inputs()
    page_attention(*args)  # the default call: the highest priority, ours
    assert last_selections()[-1].impl.name == "mine_splitk"
    page_attention(*args, logits_soft_cap=5.0)  # ours does not know the option: the next one serves
    sel = last_selections()[-1]
    assert sel.impl.name != "mine_splitk"
    assert any("skipped mine_splitk: it does not support option 'logits_soft_cap' (set to 5.0)" in w for w in sel.why)
    with pytest.raises(ConfigError, match="does not support option 'logits_soft_cap'"):
        page_attention(*args, logits_soft_cap=5.0, platform="mine_splitk")


def test_params_of_another_class_are_refused_naming_it(plugin):
    args = _paged_inputs()
    own = PageAttentionConfig(platform="mine_splitk", fwd_params=SplitParams(num_splits=4))
    page_attention(*args, cfg=own)
    assert calls[-1] == ("page_attention", SplitParams(num_splits=4))
    with pytest.raises(ConfigError, match="'mine_splitk' takes SplitParams as its fwd params, got RepeatParams"):
        page_attention(*args, cfg=PageAttentionConfig(platform="mine_splitk", fwd_params=RepeatParams()))
    with pytest.raises(ConfigError, match="SplitParams has no field.*q_blocksize"):
        page_attention(*args, cfg=PageAttentionConfig(platform="mine_splitk", fwd_params=FwdParams(q_blocksize=8)))
    assert PageAttentionConfig.from_dict(own.to_dict()) == own  # a config of typed params round-trips


def test_names_are_unique_per_op_and_select_exactly(plugin):
    with pytest.raises(ValueError, match="named 'mine_splitk' is already registered"):
        kernel_registry.register(
            "page_attention",
            "other",
            "any",
            name="mine_splitk",
            impl=split_page_attention,
            takes_call=True,
            plugin="someone-else",
        )
    names = [i.name for i in kernel_registry.implementations("page_attention", platform="mine_splitk")]
    assert names == ["mine_splitk"]
    assert "mine_splitk" in [i.name for i in kernel_registry.implementations("page_attention", platform="mine")]


def test_a_takes_call_implementation_must_accept_a_call():
    with pytest.raises(TypeError, match=r"must accept \(call, \*, fwd_params, bwd_params\)"):
        kernel_registry.register(
            "page_attention", "x", "any", name="bad", impl=lambda a, b: a, takes_call=True, plugin="bad-test"
        )


def test_seed_api():
    if not kernel_registry.implementations("flash_attention", platform="xla"):
        pytest.skip("the seed's examples name the XLA implementation (the ejkernel-xla plugin)")
    from ejkernel import Backend, Platform
    from ejkernel import kernel_registry as registry
    from ejkernel.modules import FlashAttentionConfig, flash_attention
    from ejkernel.ops.core import Kernel as SeedKernel

    assert SeedKernel is Kernel
    fn = registry.get(algorithm="flash_attention", platform=Platform.XLA, backend=Backend.ANY)
    q = jnp.ones((1, 8, 2, 16))
    assert fn(q, q, q, causal=True).shape == (1, 8, 2, 16)
    # A config naming the cpu backend is served by an implementation registered for any backend.
    out = flash_attention(q, q, q, cfg=FlashAttentionConfig(platform="xla", backend="cpu"))
    assert out.shape == (1, 8, 2, 16) and last_selections()[-1].impl.name == "xla"
