"""The ``ring_attention`` reference and layouts on cases worked out by hand.

With zero queries and keys every admitted key has the same score, so the output is the mean of the
admitted values; with ``v[p] = p`` the causal output at global position ``p`` is ``mean(0..p) = p / 2``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from ejkernel.modules import ring_attention_layout
from ejkernel.modules.operations.ring_attention import global_positions, layout_permutation
from ejkernel.testing.reference import ring_attention

needs_four = pytest.mark.skipif(
    len(jax.devices()) < 4, reason="needs >= 4 devices: run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
)


def test_positions_by_hand():
    assert global_positions("contiguous", 4, 2, 3).tolist() == [6, 7, 8]
    # 2 devices, 8 tokens, chunks of 2: device 0 holds chunks 0 and 3, device 1 chunks 1 and 2.
    assert global_positions("zigzag", 2, 0, 4).tolist() == [0, 1, 6, 7]
    assert global_positions("zigzag", 2, 1, 4).tolist() == [2, 3, 4, 5]
    assert global_positions("striped", 4, 3, 3).tolist() == [3, 7, 11]


def test_layout_permutation_by_hand():
    assert layout_permutation("contiguous", 2, 8).tolist() == list(range(8))
    assert layout_permutation("zigzag", 2, 8).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert layout_permutation("striped", 2, 8).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("n", [1, 3, 4])
def test_layout_slices_hold_each_devices_positions(layout, n):
    length = 24
    perm = layout_permutation(layout, n, length)
    assert sorted(perm.tolist()) == list(range(length)), "a permutation"
    local = length // n
    for r in range(n):
        assert perm[r * local : (r + 1) * local].tolist() == global_positions(layout, n, r, local).tolist()
    x = jnp.arange(2 * length).reshape(2, length)
    laid = ring_attention_layout(x, n, layout)
    np.testing.assert_array_equal(laid, x[:, perm])
    np.testing.assert_array_equal(ring_attention_layout(laid, n, layout, inverse=True), x)


@pytest.mark.parametrize(
    ("layout", "n", "length", "message"),
    [
        ("striped", 4, 10, "length 10 must be a multiple of the axis size 4"),
        ("zigzag", 4, 12, "local length .* must be even, got 3"),
        ("spiral", 2, 8, "layout must be one of"),
    ],
)
def test_layout_refuses_what_it_cannot_split(layout, n, length, message):
    with pytest.raises(ValueError, match=message):
        ring_attention_layout(jnp.zeros((1, length)), n, layout)


def test_without_an_axis_one_token_returns_its_value():
    q, k = jnp.ones((1, 1, 2, 4)), jnp.full((1, 1, 1, 4), 3.0)
    v = jnp.arange(4.0).reshape(1, 1, 1, 4)
    np.testing.assert_array_equal(ring_attention(q, k, v)[0, 0], [[0.0, 1.0, 2.0, 3.0]] * 2)


def test_without_an_axis_causal_uniform_scores_give_the_running_mean():
    q = k = jnp.zeros((1, 6, 1, 2))
    v = jnp.arange(6.0)[None, :, None, None].repeat(2, axis=-1)
    out = jax.jit(lambda q, k, v: ring_attention(q, k, v, causal=True, layout="zigzag"))(q, k, v)  # no axis
    np.testing.assert_allclose(out[0, :, 0, 0], np.arange(6) / 2)


@needs_four
def test_on_a_ring_causal_zigzag_gives_the_running_mean_of_the_whole_sequence():
    n, t = 4, 4
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("sp",))
    q = k = jnp.zeros((1, n * t, 1, 2))
    v = jnp.arange(n * t, dtype=jnp.float32)[None, :, None, None].repeat(2, axis=-1)
    spec = P(None, "sp")

    def attend(q, k, v):
        causal = ring_attention(q, k, v, causal=True, axis_name="sp", layout="zigzag")
        window = ring_attention(q, k, v, causal=True, sliding_window=(1, 0), axis_name="sp", layout="zigzag")
        return causal, window

    run = jax.jit(jax.shard_map(attend, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec, spec), check_vma=False))
    causal, window = run(*(ring_attention_layout(x, n, "zigzag") for x in (q, k, v)))
    p = np.arange(n * t)
    # mean(0..p) = p / 2; with a window of one key to the left, mean(p - 1, p) = p - 1/2 (p = 0: just 0).
    np.testing.assert_allclose(ring_attention_layout(causal, n, "zigzag", inverse=True)[0, :, 0, 0], p / 2, rtol=1e-6)
    np.testing.assert_allclose(
        ring_attention_layout(window, n, "zigzag", inverse=True)[0, :, 0, 0], np.maximum(p - 0.5, 0), rtol=1e-6
    )


@needs_four
def test_on_a_ring_segments_and_rows_without_keys():
    """Two segments split across devices: each row averages its own segment; causal t > s leaves rows empty."""
    n = 4
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("sp",))
    q = jnp.zeros((1, 8, 1, 1))
    k = jnp.zeros((1, 4, 1, 1))
    v = jnp.asarray([1.0, 3.0, 10.0, 20.0])[None, :, None, None]
    seg_q = jnp.asarray([[0, 0, 0, 0, 0, 1, 1, 1]], jnp.int32)
    seg_k = jnp.asarray([[0, 0, 1, 1]], jnp.int32)
    spec = P(None, "sp")

    def attend(q, k, v, sq, sk):
        plain = ring_attention(q, k, v, q_segment_ids=sq, kv_segment_ids=sk, axis_name="sp")
        return plain, ring_attention(q, k, v, causal=True, axis_name="sp")

    run = jax.jit(jax.shard_map(attend, mesh=mesh, in_specs=(spec,) * 5, out_specs=(spec, spec), check_vma=False))
    plain, causal = run(q, k, v, seg_q, seg_k)
    np.testing.assert_allclose(plain[0, :, 0, 0], [2, 2, 2, 2, 2, 15, 15, 15])
    # 8 queries, 4 keys, bottom-right aligned: query p sees keys <= p - 4; rows 0..3 see none and give 0.
    np.testing.assert_allclose(causal[0, :, 0, 0], [0, 0, 0, 0, 1, 2, 14 / 3, 8.5])
