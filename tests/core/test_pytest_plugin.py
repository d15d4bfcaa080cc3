"""The pytest plugin that the core installs (entry point ``pytest11``) leaves a user's own tests alone."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def test_a_users_test_with_a_fixture_named_impl_keeps_its_matmul_precision(tmp_path):
    (tmp_path / "test_user.py").write_text(
        textwrap.dedent(
            """
            import jax
            import pytest

            @pytest.fixture
            def impl():
                return "mine"

            def test_precision_untouched(impl):
                assert jax.config.jax_default_matmul_precision is None

            def test_our_options_exist(pytestconfig):
                assert pytestconfig.getoption("ejkernel_platform") == []
            """
        )
    )
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_user.py")],
        cwd=tmp_path,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 passed" in run.stdout


def test_the_conformance_suites_do_run_at_full_precision():
    from ejkernel.testing.conformance import _harness

    gen = _harness.ejkernel_full_precision_matmuls.__wrapped__()  # the fixture's body
    next(gen)
    import jax

    assert jax.config.jax_default_matmul_precision == "float32"
    next(gen, None)
    assert jax.config.jax_default_matmul_precision is None
