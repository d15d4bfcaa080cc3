"""The conformance harness: full float32 matmul precision in the suites (not the user's pytest at large), the
tier, the selection of implementations and the check of every candidate launch configuration."""

from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import pytest

from ejkernel.kernels import kernel_registry
from ejkernel.ops.config.base import BaseOperationConfig
from ejkernel.ops.utils.datacarrier import BwdParams, FwdParams
from ejkernel.testing.conformance._harness import _spread, check_candidate_configs, implementations_under_test


def test_conformance_tests_run_float32_matmuls_at_full_precision():
    assert jax.config.jax_default_matmul_precision == "float32"


def _fake(candidates: dict[str, list[int]], heuristic: dict[str, int]) -> tuple[Any, Any]:
    """An implementation offering ``candidates`` (q_blocksize per stage) and a kernel whose heuristic is ``heuristic``."""
    params = {"fwd": FwdParams, "bwd": BwdParams}
    impl = SimpleNamespace(
        name="fake",
        backend="any",
        candidate_cfgs=lambda inv, stage: [params[stage](q_blocksize=b) for b in candidates[stage]],
    )
    kernel = SimpleNamespace(
        op_id="fake_op",
        bind=lambda args, kwargs: dict(kwargs),
        normalize=lambda arguments: arguments,
        heuristic_cfg=lambda inv, impl, stage: params[stage](q_blocksize=heuristic[stage]),
        config_type=BaseOperationConfig,
    )
    return impl, kernel


def _blocks(params: Any) -> int | None:
    return None if params is None else params.q_blocksize


def test_candidates_but_the_heuristic_are_checked_in_pairs_and_thinned_on_the_cpu_tier():
    impl, kernel = _fake({"fwd": [64, 8, 16, 32, 128, 256], "bwd": [64, 16, 32]}, {"fwd": 64, "bwd": 64})
    seen: list[tuple[int | None, int | None]] = []
    wants: list[Any] = []

    def check(cfg: Any, want: Any) -> None:
        assert cfg.platform == "fake" and cfg.backend == "auto"
        seen.append((_blocks(cfg.fwd_params), _blocks(cfg.bwd_params)))
        wants.append(want)

    x = jnp.ones((2, 3))
    check_candidate_configs(impl, kernel, (), {"x": x}, check, tier="cpu", expected=lambda: "ref")
    assert seen == [(8, 16), (32, 32), (256, None)]  # 3 of 5 spread over the list; the bwd heuristic fills in
    assert wants == ["ref"] * 3
    seen.clear()
    check_candidate_configs(impl, kernel, (), {"x": x}, check, tier="gpu")
    assert seen == [(8, 16), (16, 32), (32, None), (128, None), (256, None)]
    seen.clear()
    check_candidate_configs(impl, kernel, (), {"x": x}, check, tier="gpu", differentiable=False)
    assert seen == [(8, None), (16, None), (32, None), (128, None), (256, None)]


def test_a_failing_candidate_is_named_and_nothing_else_skips():
    impl, kernel = _fake({"fwd": [64, 32], "bwd": [64]}, {"fwd": 64, "bwd": 64})

    def check(cfg: Any, want: Any) -> None:
        raise AssertionError("wrong")

    with pytest.raises(AssertionError, match="wrong") as failed:
        check_candidate_configs(impl, kernel, (), {"x": jnp.ones(2)}, check, tier="cpu")
    assert "fake, candidate fwd_params=FwdParams(q_blocksize=32" in "".join(failed.value.__notes__)
    only_heuristic, kernel = _fake({"fwd": [64], "bwd": [64]}, {"fwd": 64, "bwd": 64})
    with pytest.raises(pytest.skip.Exception, match="no launch configuration besides its heuristic"):
        check_candidate_configs(only_heuristic, kernel, (), {"x": jnp.ones(2)}, check, tier="gpu", expected=None)


def test_spread_keeps_the_ends():
    assert _spread(list(range(7)), 3) == [0, 3, 6]
    assert _spread([1, 2], 3) == [1, 2]


def test_ejkernel_platform_takes_an_implementations_name(pytestconfig):
    impls = kernel_registry.implementations("flash_attention", backend="all")
    if not impls:
        pytest.skip("no flash_attention implementation installed")
    impl = impls[-1]
    config = SimpleNamespace(
        getoption=lambda name, default=None: {"ejkernel_platform": [impl.name], "ejkernel_backend": impl.backend}.get(
            name, default
        )
    )
    params = implementations_under_test(config, "flash_attention")
    assert [p.values[0].name for p in params] == [impl.name]


def test_the_tier_is_the_options(tier, pytestconfig):
    assert tier == pytestconfig.getoption("ejkernel_tier") in ("cpu", "gpu")
