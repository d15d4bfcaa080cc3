"""The suites' own conftest gives every test here full float32 matmul precision (not the user's pytest at large)."""

import jax


def test_conformance_tests_run_float32_matmuls_at_full_precision():
    assert jax.config.jax_default_matmul_precision == "float32"
