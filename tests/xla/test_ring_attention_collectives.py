"""The ring attention of ejkernel-xla (the core's ring schedule on this plugin's block kernel): keys/values
travel by ``ppermute`` (never gathered), causal work is skipped or balanced, and training memory per device
is O(T)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from ejkernel.ops.utils.datacarrier import BwdParams, FwdParams
from ejkernel.schedules.ring import RingOptions, step_bounds

from ejkernel_xla.ring_attention import ring_attention

N = 4
pytestmark = pytest.mark.skipif(
    len(jax.devices()) < N, reason="needs >= 4 devices: run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
)


def _train_step(t: int, layout: str, h: int = 4, d: int = 64, block: int = 256):
    """The compiled forward + backward of a causal ring over N devices, ``t`` tokens per device."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:N]), ("sp",))
    x = jax.ShapeDtypeStruct((1, N * t, h, d), jnp.float32)
    params = {"fwd_params": FwdParams(block, block), "bwd_params": BwdParams(block, block)}
    spec = P(None, "sp")
    ring = jax.shard_map(
        lambda q, k, v: ring_attention(q, k, v, causal=True, axis_name="sp", layout=layout, **params),
        mesh=mesh,
        in_specs=(spec,) * 3,
        out_specs=spec,
        check_vma=False,
    )
    return jax.jit(jax.value_and_grad(lambda q, k, v: ring(q, k, v).sum(), argnums=(0, 1, 2))).lower(x, x, x)


def test_keys_travel_by_collective_permute_and_are_never_gathered():
    hlo = _train_step(64, "zigzag", block=32).as_text()
    assert "collective_permute" in hlo
    for gathering in ("all_gather", "all_to_all", "all_reduce", "reduce_scatter"):
        assert gathering not in hlo, f"the ring must not {gathering}"


def test_training_memory_per_device_is_linear_in_length():
    """No ``T x S`` array and no gathered sequence: temp memory is far below one dense score block and grows
    linearly when the local length doubles."""
    h, t = 4, 4096
    small = _train_step(t // 2, "zigzag", h=h).compile().memory_analysis().temp_size_in_bytes
    large = _train_step(t, "zigzag", h=h).compile().memory_analysis().temp_size_in_bytes
    dense_block = h * t * t * 4  # one float32 score matrix of local queries x one visiting shard: 256 MiB
    assert large < dense_block / 4, f"temp {large / 2**20:.1f} MiB vs a dense block {dense_block / 2**20:.0f} MiB"
    assert large / small < 2.2, f"temp grew {large / small:.2f}x when T doubled"


def _admitted(layout: str, me: int, src: int, t: int) -> int:
    """How many (query, key) pairs device ``me`` attends with the shard of device ``src`` (causal)."""
    o = RingOptions(scale=1.0, causal=True, axis_name="sp", layout=layout)
    lo, hi = step_bounds(o, N, jnp.int32(me), jnp.int32(src), t, t)
    return int(jnp.maximum(hi - lo, 0).sum())


def test_contiguous_causal_skips_later_shards_and_zigzag_balances_every_step():
    t = 8
    for me in range(N):
        for src in range(N):
            pairs = _admitted("contiguous", me, src, t)
            assert pairs == (0 if src > me else t * (t + 1) // 2 if src == me else t * t), (me, src)
            # zigzag: two chunks of c = t/2 per device; any two distinct devices share exactly two
            # fully visible chunk pairs, so every step away from the diagonal costs 2 c^2 on every device.
            c = t // 2
            want = 2 * c * c if src != me else 2 * c * c + c
            assert _admitted("zigzag", me, src, t) == want, (me, src)
            # striped: key j*N+src is admitted by query i*N+me iff j <= i (src <= me) or j < i (src > me).
            want = t * (t + 1) // 2 if src <= me else t * (t - 1) // 2
            assert _admitted("striped", me, src, t) == want, (me, src)
