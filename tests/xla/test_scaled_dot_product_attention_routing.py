"""ejkernel-xla's ``scaled_dot_product_attention`` beyond the conformance suite: the block heuristics of the
XLA path, and the cuDNN path (shared with ``flash_attention``'s), whose ``supports`` is pure logic on shapes
and options, checked here on abstract invocations (no GPU needed)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import pytest

from ejkernel.kernels import kernel_registry
from ejkernel.modules.operations.flash_attention import _kernel as flash_kernel
from ejkernel.modules.operations.scaled_dot_product_attention import _kernel as sdpa_kernel
from ejkernel.ops import Invocation

from ejkernel_xla.flash_attention import cudnn as flash_cudnn
from ejkernel_xla.scaled_dot_product_attention import candidate_cfgs, cudnn, heuristic_cfg

S = jax.ShapeDtypeStruct


def invocation(kernel: Any, t: int = 128, s: int = 128, d: int = 64, dv: int | None = None, dtype: Any = jnp.bfloat16,
               **kwargs: Any) -> Invocation:  # fmt: skip
    """A normalized abstract call, as the executor hands it to ``supports``."""
    args = (S((2, t, 8, d), dtype), S((2, s, 2, d), dtype), S((2, s, 2, dv or d), dtype))
    return Invocation.create(kernel.op_id, kernel.normalize(kernel.bind(args, kwargs)), "gpu")


def sdpa(**kwargs: Any) -> str | None:
    return cudnn.supports(invocation(sdpa_kernel, **kwargs))


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"dtype": jnp.float16, "d": 128},
        {"d": 72, "is_causal": True},
        {"t": 100, "s": 300, "is_causal": True},  # top-left causal with T != S: cuDNN's own alignment
        {"query_seq_lengths": S((2,), jnp.int32), "key_value_seq_lengths": S((2,), jnp.int32)},
        {"bias": S((1, 8, 128, 128), jnp.bfloat16)},
        {"bias": S((2, 1, 1, 128), jnp.bfloat16)},
        {"local_window_size": (16, 0)},
        {"local_window_size": 16, "is_causal": True},  # causal: the right side does not matter
    ],
)
def test_sdpa_cudnn_serves(kwargs):
    assert sdpa(**kwargs) is None


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"dtype": jnp.float32}, "needs bfloat16 or float16, got float32"),
        ({"d": 60}, "head dims multiples of 8 up to 128 with Dv == D, got D=60"),
        ({"d": 256}, "got D=256"),
        ({"dv": 32}, "Dv == D, got D=64, Dv=32"),
        ({"mask": S((2, 1, 128, 128), jnp.bool_)}, "mask is not served"),
        ({"bias": S((2, 8, 128, 128), jnp.float32)}, "bias in the query's dtype bfloat16, got float32"),
        ({"bias": S((2, 8, 127, 128), jnp.bfloat16), "t": 127}, "even T and S"),
        ({"t": 53, "s": 37, "is_causal": True}, "is_causal (jax passes it as a bias)"),  # seen failing on the H200
        ({"t": 1031, "s": 1031, "is_causal": True}, "only with even T and S"),  # likewise, T == S odd
        ({"local_window_size": 16}, "without a right side"),
        ({"local_window_size": (4, 0), "t": 200, "s": 100}, "leaves query rows without keys"),
    ],
)
def test_sdpa_cudnn_declines_with_the_reason(kwargs, reason):
    got = sdpa(**kwargs)
    assert got is not None and reason in got, got


def test_flash_attention_cudnn_keeps_its_rules():
    def flash(**kwargs: Any) -> str | None:
        return flash_cudnn.supports(invocation(flash_kernel, **kwargs))

    assert flash() is None and flash(causal=True) is None
    assert "head dims 64 and 128 with Dv == D, got D=72" in flash(d=72)
    assert "bfloat16 or float16" in flash(dtype=jnp.float32)
    assert "(bottom-right alignment)" in flash(t=64, causal=True)
    assert "causal with an odd length" in flash(t=1031, s=1031, causal=True)  # the H200 refused it in cuDNN
    assert flash(t=1031, s=1031) is None
    assert "logits_soft_cap" in flash(logits_soft_cap=5.0)


def test_hopper_takes_head_dim_256(monkeypatch):
    # Without a GPU here, stand in for an sm_90 one: cuDNN then serves D=256 (measured on the H200).
    monkeypatch.setattr(cudnn, "hopper_or_later", lambda: True)
    monkeypatch.setattr(flash_cudnn, "hopper_or_later", lambda: True)
    assert sdpa(d=256) is None and sdpa(d=136) is None
    assert "multiples of 8 up to 256" in sdpa(d=264)
    assert flash_cudnn.supports(invocation(flash_kernel, d=256)) is None
    assert "head dims 64, 128 and 256" in flash_cudnn.supports(invocation(flash_kernel, d=192))


def test_cudnn_paths_are_registered_for_gpu_with_their_supports():
    for op, module in (("scaled_dot_product_attention", cudnn), ("flash_attention", flash_cudnn)):
        impls = {i.name: i for i in kernel_registry.implementations(op, backend="gpu")}
        assert "cudnn" in impls and "xla" in impls, sorted(impls)
        gpu = impls["cudnn"]
        assert (gpu.platform, gpu.backend) == ("xla", "gpu") and gpu.priority > impls["xla"].priority
        assert gpu.supports(invocation(sdpa_kernel if op != "flash_attention" else flash_kernel, d=60)) is not None
        assert gpu.fn.__module__ == module.__name__  # imports on CPU and matches the canonical signature


def test_xla_blocks_follow_the_lengths_the_flash_kernel_runs_on():
    # Top-left causal with T = 100 < S = 3000: keys past 99 are cut, so no block needs to exceed 100.
    inv = invocation(sdpa_kernel, t=100, s=3000, dtype=jnp.float32, is_causal=True)
    fwd = heuristic_cfg(inv, "fwd")
    assert fwd.kv_blocksize is not None and fwd.kv_blocksize <= 100, fwd
    assert all(c.kv_blocksize <= 100 for c in candidate_cfgs(inv, "bwd"))
    # Without causal every key is seen: the blocks may be as long as the flash kernel likes.
    assert heuristic_cfg(invocation(sdpa_kernel, t=100, s=3000, dtype=jnp.float32), "fwd").kv_blocksize > 100
