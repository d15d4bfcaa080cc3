"""ejkernel plugin of ejkernel-triton (entry point ``[project.entry-points.ejkernel] triton``).

Registers the Triton kernels for GPUs (flash attention, the attention block, the serving decode kernels, the
grouped matmul, the fused recurrent ``gla``/``gated_delta_rule``, the chunked ``gla``, the
``multi_head_latent_attention`` decode kernel). With ``EJKERNEL_TRITON_INTERPRET=1`` it also registers them for
the CPU, where the same kernels run in Triton's interpreter: that is for tests only (slow), and the variable must
be set before anything imports ``triton`` (see ``ejkernel_triton.launch``).

The references are lazy strings, so loading this plugin imports neither Triton nor jax-triton.
"""

from __future__ import annotations

import importlib.util
import os

from ejkernel.plugins import BackendInfo, hookimpl

from ejkernel_triton import __version__

_MODULE = "ejkernel_triton.flash_attention"


def _register_flash_attention(registry, backend: str, priority: int, name: str) -> None:  # noqa: ANN001
    registry.register(
        "flash_attention",
        "triton",
        backend,
        priority=priority,
        name=name,
        impl=f"{_MODULE}:flash_attention",
        supports=f"{_MODULE}:supports",
        heuristic_cfg=f"{_MODULE}:heuristic_cfg",
        candidate_cfgs=f"{_MODULE}:candidate_cfgs",
        version=__version__,
    )


def _register_attention_block(registry, backend: str, priority: int, name: str) -> None:  # noqa: ANN001
    """The attention-block contract (forward and backward ops) on the same kernels: what a ring step runs."""
    block = f"{_MODULE}.block"
    for op, prefix, params in (("flash_attention_block", "", None), ("flash_attention_block_bwd", "bwd_", "bwd")):
        registry.register(
            op,
            "triton",
            backend,
            priority=priority,
            name=name,
            impl=f"{block}:{op}",
            supports=f"{block}:supports",
            heuristic_cfg=f"{block}:{prefix}heuristic_cfg",
            candidate_cfgs=f"{block}:{prefix}candidate_cfgs",
            fwd_params="ejkernel.kernels.params:BwdParams" if params else None,
            version=__version__,
        )


_SERVING = (  # (op, fwd params "module:class", priority offset): the Triton serving kernels
    ("page_attention", "ejkernel_triton._decode:PagedDecodeParams", 0),
    ("ragged_decode_attention", "ejkernel_triton._decode:DenseDecodeParams", 0),
    # decode rows by the split-K kernel, prefill rows in flash-style tiles (checked and timed on an H200: 4.5x XLA
    # on the serving issue's mixed batch)
    ("ragged_page_attention", "ejkernel_triton.ragged_page_attention:RaggedPageParams", 0),
)


def _register_serving(registry, backend: str, priority: int, name: str) -> None:  # noqa: ANN001
    """The serving ops (forward only: they are not differentiable)."""
    for op, params, offset in _SERVING:
        module = f"ejkernel_triton.{op}"
        registry.register(
            op,
            "triton",
            backend,
            priority=max(1, priority + offset),
            name=name,
            impl=f"{module}:{op}",
            supports=f"{module}:supports",
            heuristic_cfg=f"{module}:heuristic_cfg",
            candidate_cfgs=f"{module}:candidate_cfgs",
            fwd_params=params,
            bwd_params="ejkernel_triton._decode:ForwardOnly",
            version=__version__,
        )


def _register_grouped_matmul(registry, backend: str, priority: int, name: str) -> None:  # noqa: ANN001
    """The mixture-of-experts grouped matmul (gmm forward, gmm and tgmm backward), with its own launch params."""
    module = "ejkernel_triton.grouped_matmul"
    registry.register(
        "grouped_matmul",
        "triton",
        backend,
        priority=priority,
        name=name,
        impl=f"{module}:grouped_matmul",
        supports=f"{module}:supports",
        heuristic_cfg=f"{module}:heuristic_cfg",
        candidate_cfgs=f"{module}:candidate_cfgs",
        fwd_params=f"{module}:GmmFwdParams",
        bwd_params=f"{module}:GmmBwdParams",
        version=__version__,
    )


# The fused recurrent decode kernels (ejkernel_triton._recurrent): above the XLA implementation (10) on GPUs. Checked
# on an H200 (conformance GPU tier, gradients included) and timed there (2026-12-02, B64 T1 H16 K=V=128 bf16 with
# a float32 state: gated_delta_rule 3.28 TB/s against XLA's 1.99 and a Triton copy of the state's 2.90). They
# decline sequences longer than a few decode steps (``supports``), so training shapes stay with the chunked kernels.
_RECURRENT_GPU_PRIORITY = 110
_RECURRENT = ("gla", "gated_delta_rule")


def _register_recurrent(registry, backend: str, priority: int, name: str) -> None:  # noqa: ANN001
    """``gla`` and ``gated_delta_rule`` for decoding (forward kernel; the backward is the reference's VJP)."""
    for op in _RECURRENT:
        module = f"ejkernel_triton.{op}"
        registry.register(
            op,
            "triton",
            backend,
            priority=priority,
            name=name,
            impl=f"{module}:{op}",
            supports=f"{module}:supports",
            heuristic_cfg=f"{module}:heuristic_cfg",
            candidate_cfgs=f"{module}:candidate_cfgs",
            fwd_params="ejkernel_triton._recurrent:RecurrentParams",
            bwd_params="ejkernel_triton._recurrent:NoBwdParams",
            version=__version__,
        )


# The chunked ``gla`` kernels (ejkernel_triton.gla.chunk), forward and backward, for training shapes. Below the XLA
# implementation (10) on GPUs: they have not been checked on a GPU yet (written and checked in Triton's interpreter,
# and compiled for sm_90 without a GPU). Check and time them on one, then raise this above 10 (below the recurrent
# kernels' priority, which keeps the decode steps those serve). Registered after the recurrent kernels.
_CHUNK_GPU_PRIORITY = 5


def _register_chunk(registry, backend: str, priority: int, name: str) -> None:  # noqa: ANN001
    """``gla`` by the chunked kernels (any length; forward and backward kernels, each with its own launch params)."""
    module = "ejkernel_triton.gla.chunk"
    registry.register(
        "gla",
        "triton",
        backend,
        priority=priority,
        name=name,
        impl=f"{module}:gla",
        supports=f"{module}:supports",
        heuristic_cfg=f"{module}:heuristic_cfg",
        candidate_cfgs=f"{module}:candidate_cfgs",
        fwd_params=f"{module}:ChunkFwdParams",
        bwd_params=f"{module}:ChunkBwdParams",
        version=__version__,
    )


# The split-K decode kernel of ``multi_head_latent_attention`` (ejkernel_triton.multi_head_latent_attention). Below
# the XLA implementation (10) on GPUs until it has been checked and timed on one (it was written and checked in
# Triton's interpreter, and compiled for sm_90 without a GPU): then raise this above 10. Under
# EJKERNEL_AUTOTUNE_POLICY=autotune timing, not priority, decides.
_MLA_GPU_PRIORITY = 5


def _register_mla(registry, backend: str, priority: int, name: str) -> None:  # noqa: ANN001
    """``multi_head_latent_attention`` for decoding (forward kernel; the backward is the reference's VJP)."""
    module = "ejkernel_triton.multi_head_latent_attention"
    registry.register(
        "multi_head_latent_attention",
        "triton",
        backend,
        priority=priority,
        name=name,
        impl=f"{module}:multi_head_latent_attention",
        supports=f"{module}:supports",
        heuristic_cfg=f"{module}:heuristic_cfg",
        candidate_cfgs=f"{module}:candidate_cfgs",
        fwd_params=f"{module}:MlaDecodeParams",
        bwd_params=f"{module}:MlaBwdParams",
        version=__version__,
    )


@hookimpl
def ejkernel_register_kernels(registry) -> None:  # noqa: ANN001
    _register_flash_attention(registry, "gpu", 100, "triton")
    if os.environ.get("EJKERNEL_TRITON_INTERPRET") == "1":  # tests on CPU run the interpreter
        _register_flash_attention(registry, "cpu", 1, "triton_interpret")
    _register_attention_block(registry, "gpu", 100, "triton")
    if os.environ.get("EJKERNEL_TRITON_INTERPRET") == "1":
        _register_attention_block(registry, "cpu", 1, "triton_interpret")
    _register_serving(registry, "gpu", 100, "triton")
    if os.environ.get("EJKERNEL_TRITON_INTERPRET") == "1":
        _register_serving(registry, "cpu", 1, "triton_interpret")
    _register_grouped_matmul(registry, "gpu", 100, "triton")
    if os.environ.get("EJKERNEL_TRITON_INTERPRET") == "1":
        _register_grouped_matmul(registry, "cpu", 1, "triton_interpret")
    _register_recurrent(registry, "gpu", _RECURRENT_GPU_PRIORITY, "triton")
    if os.environ.get("EJKERNEL_TRITON_INTERPRET") == "1":
        _register_recurrent(registry, "cpu", 1, "triton_interpret")
    _register_chunk(registry, "gpu", _CHUNK_GPU_PRIORITY, "triton_chunk")
    if os.environ.get("EJKERNEL_TRITON_INTERPRET") == "1":
        _register_chunk(registry, "cpu", 1, "triton_chunk_interpret")
    _register_mla(registry, "gpu", _MLA_GPU_PRIORITY, "triton")
    if os.environ.get("EJKERNEL_TRITON_INTERPRET") == "1":
        _register_mla(registry, "cpu", 1, "triton_interpret")


def _missing_dependency() -> str | None:
    for module, dist in (("triton", "triton"), ("jax_triton", "jax-triton")):
        if importlib.util.find_spec(module) is None:
            return f"{dist} is not installed"
    return None


def _cuda_gpu() -> bool:
    import jax

    try:
        return len(jax.devices("cuda")) > 0
    except RuntimeError:  # no CUDA backend in this jaxlib, or no device
        return False


@hookimpl
def ejkernel_backend_info() -> BackendInfo:
    reason = _missing_dependency()
    if reason is None and not _cuda_gpu():
        reason = "no CUDA GPU; the Triton interpreter (EJKERNEL_TRITON_INTERPRET=1) is for tests only"
    if reason is None:
        try:  # jax-triton imports only with a CUDA jaxlib; its error says what is missing
            import jax_triton  # noqa: F401
        except ImportError as e:
            reason = f"jax_triton cannot be imported: {e}"
    return BackendInfo(
        name="ejkernel-triton",
        version=__version__,
        platforms=("triton",),
        available=reason is None,
        reason=reason,
    )
