"""The ``grouped_matmul`` reference on cases worked out by hand."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ejkernel.testing.reference import grouped_matmul


def test_each_row_uses_its_own_groups_matrix():
    lhs = jnp.arange(1.0, 6.0)[:, None] * jnp.ones((5, 2))  # row i = (i + 1, i + 1)
    rhs = jnp.stack([jnp.eye(2), 10 * jnp.eye(2), -jnp.eye(2)])
    out = grouped_matmul(lhs, rhs, jnp.array([2, 0, 2]))  # rows 0-1: group 0, rows 2-3: group 2, row 4: none
    assert out.tolist() == [[1.0, 1.0], [2.0, 2.0], [-3.0, -3.0], [-4.0, -4.0], [0.0, 0.0]]


def test_transpose_rhs_reads_each_matrix_transposed():
    rhs = jnp.asarray([[[1.0, 2.0], [0.0, 1.0]]])  # [G=1, N=2, K=2]
    lhs = jnp.asarray([[1.0, 0.0]])
    assert grouped_matmul(lhs, rhs, jnp.array([1]), transpose_rhs=True).tolist() == [[1.0, 0.0]]
    assert grouped_matmul(lhs, rhs, jnp.array([1])).tolist() == [[1.0, 2.0]]


def test_a_group_past_the_last_row_is_cut():
    lhs = jnp.ones((3, 1))
    rhs = jnp.asarray([[[2.0]], [[3.0]]])
    out = grouped_matmul(lhs, rhs, jnp.array([2, 5]))  # group 1 would cover rows 2..6; only row 2 exists
    assert out[:, 0].tolist() == [2.0, 2.0, 3.0]


def test_preferred_element_type_sets_the_result_dtype():
    lhs = jnp.full((2, 4), 0.1, jnp.bfloat16)
    rhs = jnp.ones((1, 4, 3), jnp.bfloat16)
    out = grouped_matmul(lhs, rhs, jnp.array([2]), preferred_element_type=jnp.float32)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, 4 * float(jnp.bfloat16(0.1)), rtol=1e-6)
    assert grouped_matmul(lhs, rhs, jnp.array([2])).dtype == jnp.bfloat16
