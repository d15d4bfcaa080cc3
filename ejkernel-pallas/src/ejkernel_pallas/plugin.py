"""Entry point of ejkernel-pallas (``[project.entry-points.ejkernel] pallas``).

Registers the Mosaic TPU kernels for backend ``tpu`` and the Mosaic GPU kernels (Hopper, sm_90) for
backend ``gpu``, the latter at priority 90: below ejkernel-triton (100) and cuDNN (150) until the
project settles the order from measurements. There is no TPU in CI, so with
``EJKERNEL_PALLAS_INTERPRET=1`` the TPU kernels are also registered for the CPU, where they run in
JAX's TPU interpret mode (for tests: correct but slow). ``EJKERNEL_PALLAS_DETECT_RACES=1`` turns on
the interpreter's race detection. (The GPU kernels' interpret-mode twins are called directly by
their tests, never registered.) References are lazy strings: loading the plugin imports no kernel.
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
    "gla": "ejkernel_pallas.tpu.gla",
    "grouped_matmul": "ejkernel_pallas.tpu.grouped_matmul",
    "multi_head_latent_attention": "ejkernel_pallas.tpu.multi_head_latent_attention",
    "page_attention": "ejkernel_pallas.tpu.page_attention",
    "ragged_decode_attention": "ejkernel_pallas.tpu.ragged_decode_attention",
    "ragged_page_attention": "ejkernel_pallas.tpu.ragged_page_attention",
}

_PARAMS = "ejkernel_pallas.tpu.params"
# op -> (forward, backward) launch-parameter classes of its Mosaic TPU kernel, where they are not the generic
# FwdParams/BwdParams (query and key tiles: flash_attention, block_sparse_attention, multi_head_latent_attention).
TPU_PARAMS = {
    "gla": (f"{_PARAMS}:GlaChunkParams", f"{_PARAMS}:GlaChunkParams"),
    "grouped_matmul": (f"{_PARAMS}:GmmParams", f"{_PARAMS}:GmmParams"),
    "page_attention": (f"{_PARAMS}:PagedKeyParams", f"{_PARAMS}:ForwardOnly"),
    "ragged_decode_attention": (f"{_PARAMS}:DecodeKeyParams", f"{_PARAMS}:ForwardOnly"),
    "ragged_page_attention": (f"{_PARAMS}:RaggedItemParams", f"{_PARAMS}:ForwardOnly"),
}


# op -> module of its Mosaic GPU implementation (same exports as above).
GPU_OPS = {
    "flash_attention": "ejkernel_pallas.gpu.flash_attention",
}
GPU_PRIORITY = 90


def interpret_enabled() -> bool:
    return os.environ.get("EJKERNEL_PALLAS_INTERPRET") == "1"


@hookimpl
def ejkernel_register_kernels(registry: KernelRegistry) -> None:
    targets = [("tpu", 100, "", "mosaic_tpu")]
    if interpret_enabled():
        targets.append(("cpu", 1, "_interpret", "mosaic_tpu_interpret"))
    entries = [
        (op, module, backend, priority, suffix, name, TPU_PARAMS.get(op, (None, None)))
        for op, module in TPU_OPS.items()
        for backend, priority, suffix, name in targets
    ]
    entries += [(op, module, "gpu", GPU_PRIORITY, "", "mosaic_gpu", (None, None)) for op, module in GPU_OPS.items()]
    for op, module, backend, priority, suffix, name, (fwd_params, bwd_params) in entries:
        registry.register(
            op,
            "pallas",
            backend,
            priority=priority,
            name=name,
            impl=f"{module}:{op}{suffix}",
            supports=f"{module}:supports",
            heuristic_cfg=f"{module}:heuristic_cfg",
            candidate_cfgs=f"{module}:candidate_cfgs",
            fwd_params=fwd_params,
            bwd_params=bwd_params,
            version=__version__,
        )


def _present(platform: str) -> bool:
    import jax

    try:
        return len(jax.devices(platform)) > 0
    except RuntimeError:  # no such backend in this jaxlib, or no device
        return False


@hookimpl
def ejkernel_backend_info() -> BackendInfo:
    reason = None
    # A GPU serves the Mosaic GPU kernels (which decline, call by call, GPUs older than Hopper).
    if not _present("tpu") and not _present("gpu"):
        reason = "no TPU or GPU here; set EJKERNEL_PALLAS_INTERPRET=1 to run the TPU kernels in JAX's interpreter (tests only)"
        if interpret_enabled():
            reason = (
                "no TPU or GPU here; TPU kernels run in JAX's interpreter on CPU (EJKERNEL_PALLAS_INTERPRET=1; slow)"
            )
    return BackendInfo(
        name="ejkernel-pallas",
        version=__version__,
        platforms=("pallas",),
        available=reason is None,
        reason=reason,
    )
