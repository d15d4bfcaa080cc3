"""The ``block_sparse_attention`` reference and its mask builder ``block_sparse_mask`` on cases worked out by hand."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ejkernel.modules.operations.block_sparse_attention import block_sparse_mask
from ejkernel.testing.reference import block_sparse_attention


def test_mask_without_patterns_is_dense_and_causal_clears_the_upper_blocks():
    assert block_sparse_mask(8, 8, q_block=4, kv_block=4).astype(int).tolist() == [[1, 1], [1, 1]]
    assert block_sparse_mask(8, 8, q_block=4, kv_block=4, causal=True).astype(int).tolist() == [[1, 0], [1, 1]]


def test_symmetric_local_band():
    assert block_sparse_mask(4, 4, q_block=1, kv_block=1, local_blocks=1).astype(int).tolist() == [
        [1, 1, 0, 0],
        [1, 1, 1, 0],
        [0, 1, 1, 1],
        [0, 0, 1, 1],
    ]


def test_global_blocks_are_a_row_and_a_column():
    assert block_sparse_mask(3, 3, q_block=1, kv_block=1, local_blocks=0, global_blocks=1).astype(int).tolist() == [
        [1, 1, 1],
        [1, 1, 0],
        [1, 0, 1],
    ]


def test_diagonal_is_bottom_right_aligned_and_spans_blocks():
    # T=2, S=6: queries 0 and 1 sit at key positions 4 and 5, both in key block 2 (keys 4, 5).
    assert block_sparse_mask(2, 6, q_block=1, kv_block=2, local_blocks=0).astype(int).tolist() == [[0, 0, 1], [0, 0, 1]]
    # One query block of 4 tokens at positions 0..3 spans key blocks 0 and 1 (2 keys each).
    assert block_sparse_mask(4, 4, q_block=4, kv_block=2, local_blocks=0).astype(int).tolist() == [[1, 1]]


def test_causal_with_more_queries_than_keys_empties_the_first_blocks():
    # T=4, S=2: queries 0 and 1 sit at positions -2 and -1 and see nothing.
    assert block_sparse_mask(4, 2, q_block=2, kv_block=1, causal=True).astype(int).tolist() == [[0, 0], [1, 1]]


def test_uniform_scores_give_the_mean_of_the_admitted_blocks():
    q = jnp.zeros((1, 2, 1, 2))
    k = jnp.zeros((1, 6, 1, 2))
    v = jnp.arange(12.0).reshape(1, 6, 1, 2)  # key j holds (2j, 2j + 1)
    mask = jnp.array([[True, False, True], [False, True, False]])[None, None]  # blocks of 2 keys
    out = block_sparse_attention(q, k, v, block_mask=mask, q_block=1, kv_block=2)
    # row 0: keys 0, 1, 4, 5 -> mean (5, 6); row 1: keys 2, 3 -> mean (5, 6) too, by symmetry of the choice
    np.testing.assert_allclose(out[0, :, 0], [[5.0, 6.0], [5.0, 6.0]])


def test_causal_applies_token_by_token_inside_the_diagonal_block():
    q = jnp.zeros((1, 3, 1, 1))
    k = jnp.zeros((1, 3, 1, 1))
    v = jnp.array([3.0, 6.0, 9.0]).reshape(1, 3, 1, 1)
    out = block_sparse_attention(q, k, v, q_block=4, kv_block=4, causal=True)  # a single block
    np.testing.assert_allclose(out[0, :, 0, 0], [3.0, 4.5, 6.0])


def test_a_query_block_without_keys_gives_zeros():
    q = jnp.ones((1, 4, 1, 2))
    k = v = jnp.ones((1, 4, 1, 2))
    mask = jnp.array([[True], [False]])[None, None]  # query block 1 (rows 2, 3) sees nothing
    out = block_sparse_attention(q, k, v, block_mask=mask, q_block=2, kv_block=4)
    assert out[0, :, 0].tolist() == [[1.0, 1.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]


def test_a_head_mask_applies_to_its_head_only():
    q = jnp.zeros((1, 1, 2, 1))
    k = jnp.zeros((1, 2, 1, 1))
    v = jnp.array([2.0, 4.0]).reshape(1, 2, 1, 1)
    mask = jnp.array([[[True, True]], [[False, True]]])[None]  # [1, H=2, 1, 2]: head 1 sees key block 1 only
    out = block_sparse_attention(q, k, v, block_mask=mask, q_block=1, kv_block=1)
    assert out[0, 0, :, 0].tolist() == [3.0, 4.0]
