"""Entry point of ejkernel-xla: registers the XLA implementations (lazily: nothing heavy is imported here)."""

from __future__ import annotations

from typing import Any

from ejkernel.plugins import BackendInfo, hookimpl

from ejkernel_xla import __version__


@hookimpl
def ejkernel_register_kernels(registry: Any) -> None:
    registry.register(
        "flash_attention",
        "xla",
        "any",
        priority=10,
        impl="ejkernel_xla.flash_attention:flash_attention",
        heuristic_cfg="ejkernel_xla.flash_attention:heuristic_cfg",
        candidate_cfgs="ejkernel_xla.flash_attention:candidate_cfgs",
        version=__version__,
    )
    # cuDNN through XLA, on NVIDIA GPUs. Its priority is above ejkernel-triton's (100) because it was
    # measured faster on the H200 for every call it serves (BENCHMARKS.md); Triton serves what it declines
    # (masks, soft cap, dropout, windows, varlen, D=256, float32). Under the autotune policy timing decides.
    registry.register(
        "flash_attention",
        "xla",
        "gpu",
        priority=150,
        impl="ejkernel_xla.flash_attention.cudnn:flash_attention",
        supports="ejkernel_xla.flash_attention.cudnn:supports",
        heuristic_cfg="ejkernel_xla.flash_attention.cudnn:heuristic_cfg",
        version=__version__,
    )
    # (one registration per op above this line, in the order of the catalogue)


@hookimpl
def ejkernel_backend_info() -> BackendInfo:
    return BackendInfo(name="ejkernel-xla", version=__version__, platforms=("xla",), available=True)
