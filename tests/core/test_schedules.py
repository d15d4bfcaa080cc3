"""The core's ring schedule runs each step's block through the dispatch: the highest-priority installed
implementation of ``flash_attention_block`` (and of ``flash_attention_block_bwd``) serves it, with the core alone
(the references' plugin) plus an in-test plugin that registers the schedule and a recording block implementation."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from ejkernel.kernels.params import BwdParams, FwdParams
from ejkernel.modules import RingAttentionConfig, ring_attention, ring_attention_layout
from ejkernel.ops import last_selections
from ejkernel.plugins import hookimpl, register_plugin, unregister_plugin
from ejkernel.testing import reference

N = 4
calls: list[tuple[str, Any, Any]] = []


def recording_block(query, key, value, *, q_positions=None, kv_positions=None, q_segment_ids=None,
                    kv_segment_ids=None, softmax_scale=None, causal=False, sliding_window=None, logits_soft_cap=None,
                    fwd_params=None, bwd_params=None):  # fmt: skip  # noqa: ANN001, ANN201
    calls.append(("fwd", fwd_params, q_positions is not None))
    return reference.flash_attention_block(
        query, key, value, q_positions=q_positions, kv_positions=kv_positions, q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids, softmax_scale=softmax_scale, causal=causal, sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
    )  # fmt: skip


def recording_block_bwd(query, key, value, out, lse, dout, *, dlse=None, q_positions=None, kv_positions=None,
                        q_segment_ids=None, kv_segment_ids=None, softmax_scale=None, causal=False,
                        sliding_window=None, logits_soft_cap=None, fwd_params=None, bwd_params=None):  # fmt: skip  # noqa: ANN001, ANN201
    calls.append(("bwd", fwd_params, q_positions is not None))
    return reference.flash_attention_block_bwd(
        query, key, value, out, lse, dout, dlse=dlse, q_positions=q_positions, kv_positions=kv_positions,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, softmax_scale=softmax_scale, causal=causal,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
    )  # fmt: skip


class Plugin:
    @hookimpl
    def ejkernel_register_kernels(self, registry):  # noqa: ANN001
        registry.register(
            "ring_attention", "core", "any", priority=5000, name="core_ring",
            impl="ejkernel.schedules.ring:ring_attention", heuristic_cfg="ejkernel.schedules.ring:heuristic_cfg",
            candidate_cfgs="ejkernel.schedules.ring:candidate_cfgs",
        )  # fmt: skip
        for op, fn in (("flash_attention_block", recording_block), ("flash_attention_block_bwd", recording_block_bwd)):
            registry.register(op, "mine", "any", priority=5000, name="recorder", impl=fn)


@pytest.fixture
def plugin():
    calls.clear()
    register_plugin(Plugin(), "schedules-test")
    yield
    unregister_plugin("schedules-test")


def _inputs(t: int = 8, n: int = N) -> tuple[jax.Array, ...]:
    rng = np.random.default_rng(0)
    return tuple(jnp.asarray(rng.standard_normal((2, n * t, h, 16), np.float32)) for h in (4, 2, 2))


@pytest.mark.skipif(
    len(jax.devices()) < N, reason="needs >= 4 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8"
)
def test_a_ring_step_runs_the_highest_priority_block_implementation(plugin):
    q, k, v = _inputs()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:N]), ("sp",))
    spec = P(None, "sp")

    def ring(q: Any, k: Any, v: Any) -> Any:
        lay = [ring_attention_layout(x, N, "zigzag") for x in (q, k, v)]
        out = ring_attention(*lay, causal=True, axis_name="sp", layout="zigzag", mesh=mesh,
                             in_specs=(spec,) * 3, out_specs=spec)  # fmt: skip
        return ring_attention_layout(out, N, "zigzag", inverse=True)

    cot = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)
    out, vjp = jax.vjp(jax.jit(ring), q, k, v)
    grads = vjp(cot)
    assert last_selections()[-1].op == "flash_attention_block_bwd"
    assert {("fwd", None, True), ("bwd", None, True)} <= set(calls), calls  # positions: the steps' global ones
    want, want_vjp = jax.vjp(lambda q, k, v: reference.flash_attention(q, k, v, causal=True), q, k, v)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(grads, want_vjp(cot), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
    sel = [s for s in last_selections() if s.op.startswith("flash_attention_block")]
    assert sel and all(s.impl.name == "recorder" for s in sel)


def test_a_ring_configs_params_reach_the_block_ops(plugin):
    """Without an axis the ring is one block; a ``cfg=`` with launch parameters overrides the block ops'."""
    q, k, v = _inputs(n=1)
    cfg = RingAttentionConfig(fwd_params=FwdParams(q_blocksize=16), bwd_params=BwdParams(kv_blocksize=32))
    out, vjp = jax.vjp(lambda q, k, v: ring_attention(q, k, v, causal=True, cfg=cfg), q, k, v)
    vjp(out)
    assert ("fwd", FwdParams(q_blocksize=16), False) in calls
    assert ("bwd", FwdParams(kv_blocksize=32), False) in calls  # BwdParams mapped onto the recorder's class
    np.testing.assert_allclose(out, reference.flash_attention(q, k, v, causal=True), rtol=1e-5, atol=1e-5)
