"""The ``native_sparse_attention`` reference on cases worked out by hand (zero queries: uniform attention, means)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ejkernel.testing.reference import native_sparse_attention


def _qkv(t: int, s: int) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """Zero queries and keys (every admitted key weighs the same); value j is j."""
    return jnp.zeros((1, t, 1, 1)), jnp.zeros((1, s, 1, 1)), jnp.arange(float(s)).reshape(1, s, 1, 1)


def _out(x: jnp.ndarray) -> list[float]:
    return np.asarray(x[0, :, 0, 0]).tolist()


def test_selected_blocks_are_cut_causally():
    q, k, v = _qkv(4, 4)
    idx = jnp.array([0, 0, 1, 1]).reshape(1, 4, 1, 1)  # rows 0, 1 select block 0; rows 2, 3 block 1 (block_size 2)
    np.testing.assert_allclose(_out(native_sparse_attention(q, k, v, idx, block_size=2)), [0.0, 0.5, 2.0, 2.5])


def test_non_causal_selection_sees_whole_blocks():
    q, k, v = _qkv(2, 4)
    idx = jnp.array([[1, -1], [0, 1]]).reshape(1, 2, 1, 2)
    out = native_sparse_attention(q, k, v, idx, block_size=2, causal=False)
    np.testing.assert_allclose(_out(out), [2.5, 1.5])


def test_counts_use_the_first_slots_and_repeats_count_once():
    q, k, v = _qkv(1, 6)
    idx = jnp.array([0, 0, 2]).reshape(1, 1, 1, 3)  # block 0 twice, then block 2 (keys 4, 5)
    np.testing.assert_allclose(_out(native_sparse_attention(q, k, v, idx, block_size=2)), [(0 + 1 + 4 + 5) / 4])
    np.testing.assert_allclose(_out(native_sparse_attention(q, k, v, idx, block_size=2, block_counts=2)), [0.5])


def test_a_token_without_a_visible_block_gives_zeros():
    q, k, v = _qkv(3, 3)
    idx = jnp.array([1, -1, 7]).reshape(1, 3, 1, 1)  # row 0: block 1 is in its future; a pad; past the end
    assert _out(native_sparse_attention(q, k, v, idx, block_size=2)) == [0.0, 0.0, 0.0]


def test_compressed_branch_averages_complete_blocks():
    q, k, v = _qkv(5, 5)
    idx = jnp.full((1, 5, 1, 1), -1)
    gate = jnp.ones((1, 5, 1))
    out = native_sparse_attention(q, k, v, idx, block_size=2, g_cmp=gate)
    # Block means 0.5, 2.5, 4 (the last block holds key 4 only). Row i sees blocks n with 2n + 1 <= i.
    np.testing.assert_allclose(_out(out), [0.0, 0.5, 0.5, 1.5, 1.5])
    out = native_sparse_attention(q, k, v, idx, block_size=2, g_cmp=gate, causal=False)
    np.testing.assert_allclose(_out(out), [7.0 / 3] * 5)


def test_sliding_window_averages_the_latest_keys():
    q, k, v = _qkv(4, 4)
    idx = jnp.full((1, 4, 1, 1), -1)
    out = native_sparse_attention(q, k, v, idx, block_size=2, g_swa=jnp.ones((1, 4, 1)), window_size=2)
    np.testing.assert_allclose(_out(out), [0.0, 0.5, 1.5, 2.5])


def test_gates_weigh_the_branches():
    q, k, v = _qkv(4, 4)
    idx = jnp.zeros((1, 4, 1, 1), jnp.int32)  # block 0: keys 0, 1
    slc, cmp, swa = jnp.full((1, 4, 1), 2.0), jnp.full((1, 4, 1), 10.0), jnp.full((1, 4, 1), 100.0)
    out = native_sparse_attention(q, k, v, idx, block_size=2, g_slc=slc, g_cmp=cmp, g_swa=swa, window_size=1)
    # selected: 0, 0.5, 0.5, 0.5; compressed: 0, 0.5, 0.5, 1.5; window of 1: the key itself.
    np.testing.assert_allclose(_out(out), [0.0, 1 + 5 + 100, 1 + 5 + 200, 1 + 15 + 300])
