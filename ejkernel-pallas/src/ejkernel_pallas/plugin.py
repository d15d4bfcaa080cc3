"""Entry point of ejkernel-pallas (``[project.entry-points.ejkernel] pallas``).

Registers the Mosaic TPU kernels for backend ``tpu``. There is no TPU in CI, so with
``EJKERNEL_PALLAS_INTERPRET=1`` the same kernels are also registered for the CPU, where they run in
JAX's TPU interpret mode (for tests: correct but slow). ``EJKERNEL_PALLAS_DETECT_RACES=1`` turns on
the interpreter's race detection. References are lazy strings: loading the plugin imports no kernel.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ejkernel.plugins import BackendInfo, hookimpl

from ejkernel_pallas import __version__

if TYPE_CHECKING:
    from ejkernel.kernels import KernelRegistry

# op -> module of its Mosaic TPU implementation (each exports the op's function, its ``_interpret``
# twin, ``supports``, ``heuristic_cfg`` and ``candidate_cfgs``).
TPU_OPS = {
    "block_sparse_attention": "ejkernel_pallas.tpu.block_sparse_attention",
    "flash_attention": "ejkernel_pallas.tpu.flash_attention",
    "grouped_matmul": "ejkernel_pallas.tpu.grouped_matmul",
    "multi_head_latent_attention": "ejkernel_pallas.tpu.multi_head_latent_attention",
    "page_attention": "ejkernel_pallas.tpu.page_attention",
    "ragged_decode_attention": "ejkernel_pallas.tpu.ragged_decode_attention",
    "ragged_page_attention": "ejkernel_pallas.tpu.ragged_page_attention",
}


def interpret_enabled() -> bool:
    return os.environ.get("EJKERNEL_PALLAS_INTERPRET") == "1"


@hookimpl
def ejkernel_register_kernels(registry: KernelRegistry) -> None:
    targets = [("tpu", 100, "")]
    if interpret_enabled():
        targets.append(("cpu", 1, "_interpret"))
    for op, module in TPU_OPS.items():
        for backend, priority, suffix in targets:
            registry.register(
                op,
                "pallas",
                backend,
                priority=priority,
                impl=f"{module}:{op}{suffix}",
                supports=f"{module}:supports",
                heuristic_cfg=f"{module}:heuristic_cfg",
                candidate_cfgs=f"{module}:candidate_cfgs",
                version=__version__,
            )


def _tpu_present() -> bool:
    import jax

    try:
        return len(jax.devices("tpu")) > 0
    except RuntimeError:  # no TPU backend in this jaxlib, or no device
        return False


@hookimpl
def ejkernel_backend_info() -> BackendInfo:
    reason = None
    if not _tpu_present():
        reason = "no TPU here; set EJKERNEL_PALLAS_INTERPRET=1 to run the TPU kernels in JAX's interpreter (tests only)"
        if interpret_enabled():
            reason = "no TPU here; TPU kernels run in JAX's interpreter on CPU (EJKERNEL_PALLAS_INTERPRET=1; slow)"
    return BackendInfo(
        name="ejkernel-pallas",
        version=__version__,
        platforms=("pallas",),
        available=reason is None,
        reason=reason,
    )
