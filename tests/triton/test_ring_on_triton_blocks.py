"""The core's ring schedule on ejkernel-triton's attention blocks, in Triton's interpreter (CPU, 4 simulated devices):
the ring is written once, and a GPU ring runs the Triton block kernels (here forced through an overlay, as the
interpreter's registration has the lowest priority). ejkernel-xla registers the schedule as its ``ring_attention``;
so that this runs with ejkernel-triton alone, an in-test plugin registers it too."""

from __future__ import annotations

import importlib.util
import os

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed: the Triton interpreter tests need it", allow_module_level=True)

# Before anything imports triton: Triton decorates its own tl.* helpers at import time.
os.environ["EJKERNEL_TRITON_INTERPRET"] = "1"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from ejkernel.modules import (  # noqa: E402
    FlashAttentionBlockBwdConfig,
    FlashAttentionBlockConfig,
    ring_attention,
    ring_attention_layout,
)
from ejkernel.ops import last_selections, overlay  # noqa: E402
from ejkernel.plugins import hookimpl, register_plugin, unregister_plugin  # noqa: E402
from ejkernel.testing import reference  # noqa: E402

N = 4


class CoreRing:
    @hookimpl
    def ejkernel_register_kernels(self, registry):  # noqa: ANN001
        registry.register(
            "ring_attention", "core", "any", name="core_ring", impl="ejkernel.schedules.ring:ring_attention"
        )


@pytest.fixture
def core_ring():
    register_plugin(CoreRing(), "core-ring-test")
    yield
    unregister_plugin("core-ring-test")


@pytest.mark.skipif(
    len(jax.devices()) < N, reason="needs >= 4 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8"
)
@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_ring_on_triton_blocks_matches_the_reference(layout, core_ring):
    rng = np.random.default_rng(0)
    b, n, h, kh, d = 1, N * 8, 2, 1, 16
    q, k, v = (jnp.asarray(rng.standard_normal((b, n, x, d), np.float32)) for x in (h, kh, kh))
    segs = jnp.asarray(np.sort(rng.integers(0, 2, (b, n)), axis=-1), jnp.int32)
    options = {"causal": True, "sliding_window": (11, 0), "logits_soft_cap": 4.0}
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:N]), ("sp",))
    spec = P(None, "sp")

    def ring(q, k, v):  # noqa: ANN001, ANN202
        lay = [ring_attention_layout(x, N, layout) for x in (q, k, v, segs)]
        out = ring_attention(*lay[:3], q_segment_ids=lay[3], kv_segment_ids=lay[3], axis_name="sp", layout=layout,
                             platform="core_ring", mesh=mesh, in_specs=(spec,) * 5, out_specs=spec, **options)  # fmt: skip
        return ring_attention_layout(out, N, layout, inverse=True)

    cot = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    forced = {
        "flash_attention_block": FlashAttentionBlockConfig(platform="triton_interpret"),
        "flash_attention_block_bwd": FlashAttentionBlockBwdConfig(platform="triton_interpret"),
    }
    with overlay(forced):
        out, vjp = jax.vjp(jax.jit(ring), q, k, v)
        grads = vjp(cot)
    blocks = [s for s in last_selections() if s.op.startswith("flash_attention_block")]
    assert {s.op for s in blocks} == {"flash_attention_block", "flash_attention_block_bwd"}
    assert all(s.impl.name == "triton_interpret" for s in blocks)
    ref = lambda q, k, v: reference.flash_attention(q, k, v, q_segment_ids=segs, kv_segment_ids=segs, **options)  # noqa: E731
    want, want_vjp = jax.vjp(ref, q, k, v)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
    for g, w in zip(grads, want_vjp(cot), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
