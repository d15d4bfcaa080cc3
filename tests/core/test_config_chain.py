"""The seven tiers of the config chain, with a real in-test implementation whose candidates differ in cost."""

from __future__ import annotations

import json

import jax
import pytest

import ejkernel.ops as ops
from ejkernel.modules import FlashAttentionConfig, flash_attention
from ejkernel.ops.config.chain import ConfigError

from ._plugins import BWD_CANDIDATES, FWD_CANDIDATES, calls

FAST_FWD, FAST_BWD = FWD_CANDIDATES[1], BWD_CANDIDATES[1]


def _qkv(seed=None, shape=(1, 256, 8, 64)):
    key = jax.random.key(seed if seed is not None else int.from_bytes(__import__("os").urandom(2), "little"))
    return tuple(jax.random.normal(k, shape) for k in jax.random.split(key, 3))


def _selections(stage):
    return [s for s in ops.last_selections() if s.stage == stage]


def _cache_entries(cache_dir):
    return {k: v for f in cache_dir.glob("*/*.json") for k, v in json.loads(f.read_text())["entries"].items()}


@pytest.mark.parametrize("policy", ["autotune", "heuristics", "error"])
def test_override_wins_under_every_policy_and_is_never_persisted(costly_plugin, isolated_cache, monkeypatch, policy):
    monkeypatch.setenv("EJKERNEL_AUTOTUNE_POLICY", policy)
    q, k, v = _qkv()
    cfg = FlashAttentionConfig(platform="costly", fwd_params=FWD_CANDIDATES[2], bwd_params=BWD_CANDIDATES[0])
    jax.grad(lambda q: flash_attention(q, k, v, cfg=cfg).sum())(q)
    fwd, bwd = _selections("fwd")[-1], _selections("bwd")[-1]
    assert (fwd.tier, fwd.params, bwd.tier, bwd.params) == (
        "override",
        FWD_CANDIDATES[2],
        "override",
        BWD_CANDIDATES[0],
    )
    assert calls[-1] == (FWD_CANDIDATES[2], BWD_CANDIDATES[0])
    assert _cache_entries(isolated_cache) == {}
    assert ops.default_chain().memory == {}


def test_override_with_unset_params_takes_the_heuristic(costly_plugin):
    q, k, v = _qkv()
    flash_attention(q, k, v, cfg=FlashAttentionConfig(platform="costly"))
    assert _selections("fwd")[-1].params.num_stages == 4


def test_eager_autotune_picks_the_cheap_candidates_and_persists_them(costly_plugin, isolated_cache, monkeypatch):
    monkeypatch.setenv("EJKERNEL_AUTOTUNE_POLICY", "autotune")
    q, k, v = _qkv()
    jax.grad(lambda q: flash_attention(q, k, v, platform="costly").sum())(q)
    fwd, bwd = _selections("fwd")[-1], _selections("bwd")[-1]
    assert (fwd.tier, fwd.params) == ("autotune", FAST_FWD)
    assert (bwd.tier, bwd.params) == ("autotune", FAST_BWD)
    # The candidates really ran: 48 stages of work cost several times one stage.
    t = {tm.label: tm.seconds for tm in fwd.timings}
    slow = next(s for label, s in t.items() if "'num_stages': 40" in label)
    fast = next(s for label, s in t.items() if "'num_stages': 1}" in label)
    assert slow > 4 * fast, t
    # fwd, then (differentiated) train = fwd timed with the backward, then bwd
    entries = _cache_entries(isolated_cache)
    assert sorted(e["params"]["num_stages"] for e in entries.values()) == [1, 1, 2]
    train = _selections("train")[-1]
    assert (train.tier, train.params) == ("autotune", FAST_FWD)


def test_differentiated_calls_pick_by_forward_plus_backward_time(costly_plugin, isolated_cache, monkeypatch):
    # "lopsided" has the cheapest forward (no work) and the dearest backward (80 rounds): timed by its
    # forward it is a contender, by forward+backward it must lose.
    from ejkernel.kernels.registry import kernel_registry
    from ejkernel.plugins import register_plugin, unregister_plugin

    from ._plugins import LopsidedPlugin

    monkeypatch.setenv("EJKERNEL_AUTOTUNE_POLICY", "autotune")
    # Only the two in-test kernels compete (installed plugins would be timed too: slow in their interpreters).
    everything = kernel_registry.implementations
    monkeypatch.setattr(
        kernel_registry,
        "implementations",
        lambda *a, **kw: [i for i in everything(*a, **kw) if i.platform in ("costly", "lopsided")],
    )
    register_plugin(LopsidedPlugin(), "lopsided-test")
    try:
        q, k, v = _qkv(shape=(1, 1024, 8, 64))  # long enough that one round of work outweighs a call's overhead
        jax.grad(lambda q: flash_attention(q, k, v).sum())(q)
        fwd, train, bwd = _selections("fwd")[-1], _selections("train")[-1], _selections("bwd")[-1]
        assert train.tier == "autotune" and train.impl.name != "lopsided:any", train.why
        assert bwd.impl is train.impl
        fwd_t = {tm.label.split()[0]: tm.seconds for tm in fwd.timings}
        train_t = {tm.label.split()[0]: tm.seconds for tm in train.timings}
        # what made it lose was the backward: its forward alone is a fraction of its forward+backward
        assert fwd_t["lopsided:any"] * 5 < train_t["lopsided:any"], (fwd_t, train_t)
        assert train_t["lopsided:any"] > 2 * min(train_t.values()), train_t
    finally:
        unregister_plugin("lopsided-test")


@pytest.mark.parametrize("transform", ["jit", "grad", "vmap", "jit_grad_vmap"])
def test_autotune_under_transforms_matches_eager(costly_plugin, monkeypatch, transform):
    monkeypatch.setenv("EJKERNEL_AUTOTUNE_POLICY", "autotune")
    q, k, v = _qkv()
    attn = lambda q, k, v: flash_attention(q, k, v, platform="costly")  # noqa: E731
    loss = lambda q, k, v: attn(q, k, v).sum()  # noqa: E731
    if transform == "jit":
        jax.jit(attn)(q, k, v)
    elif transform == "grad":
        jax.grad(loss)(q, k, v)
    elif transform == "vmap":
        jax.vmap(attn)(q[None], k[None], v[None])
    else:
        jax.jit(jax.vmap(jax.grad(loss)))(q[None], k[None], v[None])
    fwd = _selections("fwd")[-1]
    assert (fwd.tier, fwd.params) == ("autotune", FAST_FWD)
    assert len(fwd.timings) == len(FWD_CANDIDATES) and all(t.seconds for t in fwd.timings)
    if transform in ("grad", "jit_grad_vmap"):
        assert (_selections("bwd")[-1].tier, _selections("bwd")[-1].params) == ("autotune", FAST_BWD)
    else:
        assert _selections("bwd") == []  # no differentiation: the backward is neither resolved nor tuned


def test_memory_then_persistent_cache_serve_later_calls(costly_plugin, isolated_cache, monkeypatch):
    monkeypatch.setenv("EJKERNEL_AUTOTUNE_POLICY", "autotune")
    q, k, v = _qkv()
    flash_attention(q, k, v, platform="costly")
    flash_attention(q, k, v, platform="costly")
    assert (_selections("fwd")[-1].tier, _selections("fwd")[-1].params) == ("memory", FAST_FWD)
    # A new process (a fresh chain) reads the file; no policy is needed for that.
    ops.default_chain().memory.clear()
    monkeypatch.setenv("EJKERNEL_AUTOTUNE_POLICY", "error")
    import ejkernel.ops.config.chain as chain_module

    monkeypatch.setattr(chain_module, "_default_chain", None)
    flash_attention(q, k, v, platform="costly")
    assert (_selections("fwd")[-1].tier, _selections("fwd")[-1].params) == ("persistent", FAST_FWD)


def test_heuristics_policy_does_not_tune(costly_plugin, isolated_cache):
    q, k, v = _qkv()
    flash_attention(q, k, v, platform="costly")
    assert (_selections("fwd")[-1].tier, _selections("fwd")[-1].params.num_stages) == ("heuristics", 4)
    assert _cache_entries(isolated_cache) == {}


def test_error_policy_names_op_shapes_device_and_tiers(costly_plugin, monkeypatch):
    monkeypatch.setenv("EJKERNEL_AUTOTUNE_POLICY", "error")
    q, k, v = _qkv()
    with pytest.raises(ConfigError) as e:
        flash_attention(q, k, v, platform="costly")
    msg = str(e.value)
    for needle in (
        "flash_attention",
        "float32[1, 256, 8, 64]",
        ops.fingerprint_id(),
        "override",
        "overlay",
        "memory",
        "persistent",
        "EJKERNEL_AUTOTUNE_POLICY=error",
    ):
        assert needle in msg, (needle, msg)


def test_bad_policy_is_refused(monkeypatch):
    monkeypatch.setenv("EJKERNEL_AUTOTUNE_POLICY", "fastest")
    q, k, v = _qkv(shape=(1, 8, 1, 8))
    with pytest.raises(ValueError, match="EJKERNEL_AUTOTUNE_POLICY must be one of"):
        flash_attention(q, k, v)


def test_overlay_is_used_and_is_part_of_the_jit_key(costly_plugin):
    q, k, v = _qkv()
    traces = []

    @jax.jit
    def f(q, k, v):
        traces.append(1)
        return flash_attention(q, k, v, platform="costly")

    f(q, k, v)
    with ops.overlay({"flash_attention": FlashAttentionConfig(platform="costly", fwd_params=FWD_CANDIDATES[2])}):
        f(q, k, v)
        sel = _selections("fwd")[-1]
    assert len(traces) == 2, "entering an overlay must re-trace"
    assert (sel.tier, sel.params) == ("overlay", FWD_CANDIDATES[2])


def test_unsupported_option_skips_the_implementation_with_its_reason(costly_plugin):
    q, k, v = _qkv()
    flash_attention(q, k, v, logits_soft_cap=5.0)  # served by someone else (the XLA plugin where installed)...
    assert "skipped costly:any: logits_soft_cap is not supported" in _selections("fwd")[-1].why


def test_forcing_a_platform_that_cannot_serve_says_why(costly_plugin):
    q, k, v = _qkv()
    with pytest.raises(ConfigError, match="platform 'costly' cannot serve .*logits_soft_cap is not supported"):
        flash_attention(q, k, v, platform="costly", logits_soft_cap=5.0)


def test_unknown_platform_is_an_error_naming_it():
    q, k, v = _qkv(shape=(1, 8, 1, 8))
    with pytest.raises(ConfigError, match="'nosuch'"):
        flash_attention(q, k, v, platform="nosuch")


def test_cfg_of_the_wrong_type_is_refused():
    q, k, v = _qkv(shape=(1, 8, 1, 8))
    with pytest.raises(TypeError, match="cfg must be a FlashAttentionConfig"):
        flash_attention(q, k, v, cfg={"platform": "xla"})


def test_failed_candidates_are_skipped_and_reported(costly_plugin, monkeypatch):
    from ejkernel.ops.utils.datacarrier import FwdParams

    from . import _plugins

    monkeypatch.setenv("EJKERNEL_AUTOTUNE_POLICY", "autotune")
    monkeypatch.setattr(_plugins, "FWD_CANDIDATES", [FwdParams(num_stages=1, q_blocksize=3), FAST_FWD])
    broken = _plugins.costly_attention

    def picky(*args, fwd_params=None, **kwargs):
        if fwd_params is not None and fwd_params.q_blocksize == 3:
            raise ValueError("block size 3 is not a power of two")
        return broken(*args, fwd_params=fwd_params, **kwargs)

    from ejkernel.kernels import kernel_registry

    impl = kernel_registry.implementations("flash_attention", platform="costly")[0]
    monkeypatch.setattr(impl, "_fn", picky)
    q, k, v = _qkv()
    flash_attention(q, k, v, platform="costly")
    sel = _selections("fwd")[-1]
    assert sel.params == FAST_FWD
    assert any("1 failed" in w and "not a power of two" in w for w in sel.why)


def test_stamp_names_the_scope_in_the_lowered_program(costly_plugin, monkeypatch):
    q, k, v = _qkv()
    for mode, present in (("json", '"impl":"costly:any"'), ("hash", "ejkernel.flash_attention:costly:any:")):
        monkeypatch.setenv("EJKERNEL_OPS_STAMP", mode)
        text = jax.jit(lambda q: flash_attention(q, k, v, platform="costly")).lower(q).as_text(debug_info=True)
        assert present.replace('"', "") in text.replace("\\22", "").replace('"', ""), mode
    monkeypatch.setenv("EJKERNEL_OPS_STAMP", "none")
    text = jax.jit(lambda q: flash_attention(q, k, v, platform="costly")).lower(q).as_text(debug_info=True)
    assert "ejkernel.flash_attention" not in text


def test_record_appends_invocations(costly_plugin, isolated_cache, monkeypatch):
    monkeypatch.setenv("EJKERNEL_OPS_RECORD", "1")
    q, k, v = _qkv()
    flash_attention(q, k, v, platform="costly", causal=True)
    lines = (isolated_cache / "invocations.jsonl").read_text().splitlines()
    rec = json.loads(lines[-1])
    assert rec["op"] == "flash_attention" and rec["impl"] == "costly:any" and rec["arguments"]["causal"] is True
    assert ops.recorded_invocations()[-1] == rec


def test_no_candidates_to_time_falls_back_to_the_heuristic_and_says_so(costly_plugin, monkeypatch):
    from . import _plugins

    monkeypatch.setenv("EJKERNEL_AUTOTUNE_POLICY", "autotune")
    monkeypatch.setattr(_plugins, "FWD_CANDIDATES", [])
    q, k, v = _qkv()
    flash_attention(q, k, v, platform="costly")
    sel = _selections("fwd")[-1]
    assert sel.tier == "heuristics"
    assert any("offers no candidates" in w for w in sel.why), sel.why
    assert not any("failed" in w for w in sel.why), sel.why
