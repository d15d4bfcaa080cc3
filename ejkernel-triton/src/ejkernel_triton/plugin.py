"""ejkernel plugin of ejkernel-triton (entry point ``[project.entry-points.ejkernel] triton``).

Registers the Triton kernels for GPUs (flash attention, the attention block, the serving decode kernels, the
grouped matmul, the fused recurrent ``gla``/``gated_delta_rule``/``lightning_attn``/``recurrent``, the chunked
``gla``/``lightning_attn``/``recurrent``/``gated_delta_rule``, the
``multi_head_latent_attention`` decode kernel). With ``EJKERNEL_TRITON_INTERPRET=1`` it also registers them for
the CPU, where the same kernels run in Triton's interpreter: that is for tests only (slow), and the
variable must be set before anything imports ``triton`` (see ``ejkernel_triton.launch``).

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


def _register(registry, backend: str, priority: int, name: str, op: str, module: str, fwd: str, bwd: str) -> None:  # noqa: ANN001
    """``op`` by ``ejkernel_triton.<module>`` (its ``op``, ``supports``, ``heuristic_cfg``, ``candidate_cfgs``), with
    launch parameter classes ``fwd``/``bwd`` ("module:class")."""
    module = f"ejkernel_triton.{module}"
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
        fwd_params=fwd,
        bwd_params=bwd,
        version=__version__,
    )


_DECODE, _RECURRENT = "ejkernel_triton._decode", "ejkernel_triton._recurrent"
_CHUNK_FWD, _CHUNK_BWD = "ejkernel_triton.gla.chunk:ChunkFwdParams", "ejkernel_triton.gla.chunk:ChunkBwdParams"
# The fused recurrent decode kernels (ejkernel_triton._recurrent): above the XLA implementation (10) on GPUs. Checked
# on an H200 (conformance GPU tier, gradients included) and timed there (2026-12-02, B64 T1 H16 K=V=128 bf16 with
# a float32 state: gated_delta_rule 3.28 TB/s against XLA's 1.99 and a Triton copy of the state's 2.90). They
# decline sequences longer than a few decode steps (``supports``), so training shapes go to the chunked kernels.
_RECURRENT_GPU_PRIORITY = 110
# The chunked ``gla`` kernels (ejkernel_triton.gla.chunk), forward and backward: above XLA (10) on GPUs, below the
# fused recurrent decode kernel (110). Checked on an H200 (conformance GPU tier, gradients included, and
# benchmarks/gpucheck/gla_chunk.py, 2026-12-04) and timed there at B4 T4096 H16 K=V=128 bf16: forward 1.51 ms against
# XLA's 2.99, forward+backward 4.25 against 7.86 (flash-linear-attention: about 0.9-1.0 and 4.15). lightning_attn and
# recurrent chunked (_CHUNK_GPU_PRIORITY): above XLA too. With a key gate recurrent runs gla's kernels (forward 16.0
# against XLA's 9.8 TFLOP/s, forward+backward 14.9 against 12.7, `ejkernel bench recurrent`, 2026-12-04); without
# one both run simple_gla's (ejkernel_triton._simple_chunk; `ejkernel bench lightning_attn|recurrent`, same shape,
# 2026-12-04 session of 16:15, outputs and gradients checked first on the GPU: forward 95 TFLOP/s against XLA's 10.8
# and fla chunk_simple_gla's 65-69, forward+backward 56 against 12.3; fla refuses its backward on Triton 3.6).
_CHUNK_GPU_PRIORITY = 50
# lightning_attn/recurrent decode on gla's fused kernel: below XLA on GPUs. Their GPU tier passed on an H200
# (2026-12-03). Reading one decay per token and head (GATE_K off) did not make it faster: lightning's decode step
# (`ejkernel bench lightning_attn-decode --preset lightning-decode`, 2026-12-04, float32 state [B, H16, 128, 128])
# read 3.19 TB/s against XLA's 3.42 at B64, 3.36 against 3.81 at B256, 0.125 against 0.133 at B1.
_FOLDED_DECODE_GPU_PRIORITY = 5
# recurrent with a value gate on the value-side chunked kernels (ejkernel_triton._value_chunk): above XLA (10) on GPUs,
# below the fused recurrent decode kernel (110; these decline decode steps). Checked on an H200 (2026-12-04:
# benchmarks/gpucheck/value_chunk.py against XLA, bf16 and f32, every gradient; the conformance GPU tier's value-gate
# cases) and timed there at B4 T4096 H16 K=V=128 bf16 with the backward of 2bcda3d (each chunk's pair matrices once):
# forward 1.38 ms against XLA's 2.73, forward+backward 6.90 against 8.43 (the backward before it: 11.17 against 8.24).
_VALUE_CHUNK_GPU_PRIORITY = 50
# The chunked gated_delta_rule (the WY representation): above XLA (10) on GPUs, below the fused recurrent decode
# kernel (110), which takes decode steps and declines longer sequences. Checked on an H200 (conformance GPU tier at
# every candidate, gradients included, 2026-12-04) and timed there at B4 T4096 H16 K=V=128 bf16: forward 0.89 ms
# against XLA's 3.56, forward+backward 3.75 ms against XLA's 9.30 (benchmarks/gpucheck/gdr_fwd_bwd.py). float32
# inputs (three tf32 passes, some spills) are checked but not timed.
_GDR_CHUNK_GPU_PRIORITY = 50
# The split-K decode kernel of ``multi_head_latent_attention``: above XLA on GPUs. Its output was checked against the
# reference on an H200 and it read 0.98 TB/s at DeepSeek-V3 dims (B64 x 4096, H128) against XLA's 0.089, and 2.46
# with 16 heads (2026-12-04; a copy reaches 3.65-3.9: see BENCHMARKS.md). Its backward is the reference's VJP.
_MLA_GPU_PRIORITY = 100
# (op, module, fwd params, bwd params, priority on GPUs, name suffix): registered for GPUs as "triton<suffix>", and
# for the CPU as "triton<suffix>_interpret" at priority 1 when EJKERNEL_TRITON_INTERPRET=1.
_KERNELS = (
    # The serving ops are not differentiable (no backward). ragged_page_attention: decode rows by the split-K kernel,
    # prefill rows in flash-style tiles (checked and timed on an H200: 4.5x XLA on the serving issue's mixed batch).
    ("page_attention", "page_attention", f"{_DECODE}:PagedDecodeParams", f"{_DECODE}:ForwardOnly", 100, ""),
    ("ragged_decode_attention", "ragged_decode_attention", f"{_DECODE}:DenseDecodeParams", f"{_DECODE}:ForwardOnly",
     100, ""),
    ("ragged_page_attention", "ragged_page_attention", "ejkernel_triton.ragged_page_attention:RaggedPageParams",
     f"{_DECODE}:ForwardOnly", 100, ""),
    # The mixture-of-experts grouped matmul: gmm forward, gmm and tgmm backward, each with its own launch params.
    ("grouped_matmul", "grouped_matmul", "ejkernel_triton.grouped_matmul:GmmFwdParams",
     "ejkernel_triton.grouped_matmul:GmmBwdParams", 100, ""),
    # Decoding (a forward kernel; the backward is the reference's VJP).
    ("gla", "gla", f"{_RECURRENT}:RecurrentParams", f"{_RECURRENT}:NoBwdParams", _RECURRENT_GPU_PRIORITY, ""),
    ("gated_delta_rule", "gated_delta_rule", f"{_RECURRENT}:RecurrentParams", f"{_RECURRENT}:NoBwdParams",
     _RECURRENT_GPU_PRIORITY, ""),
    # lightning_attn and recurrent decode on gla's kernel, their gates folded into its key-side log decay
    # (ejkernel_triton._gates; recurrent's value gate as a second, value-side one).
    ("lightning_attn", "lightning_attn", f"{_RECURRENT}:RecurrentParams", f"{_RECURRENT}:NoBwdParams",
     _FOLDED_DECODE_GPU_PRIORITY, ""),
    ("recurrent", "recurrent", f"{_RECURRENT}:RecurrentParams", f"{_RECURRENT}:NoBwdParams",
     _FOLDED_DECODE_GPU_PRIORITY, ""),
    # The chunked kernels (training shapes); lightning_attn and recurrent without a key gate on the scalar-decay
    # kernels (ejkernel_triton._simple_chunk), recurrent with one on gla's (its gates folded as for decoding).
    ("gla", "gla.chunk", _CHUNK_FWD, _CHUNK_BWD, _CHUNK_GPU_PRIORITY, "_chunk"),
    ("lightning_attn", "lightning_attn.chunk", _CHUNK_FWD, _CHUNK_BWD, _CHUNK_GPU_PRIORITY, "_chunk"),
    ("recurrent", "recurrent.chunk", _CHUNK_FWD, _CHUNK_BWD, _CHUNK_GPU_PRIORITY, "_chunk"),
    # recurrent with a value gate (no key gate): the value-side chunked kernels.
    ("recurrent", "recurrent.value_chunk", _CHUNK_FWD, _CHUNK_BWD, _VALUE_CHUNK_GPU_PRIORITY, "_value_chunk"),
    # The chunked gated_delta_rule (the WY representation), forward and backward.
    ("gated_delta_rule", "gated_delta_rule.chunk", _CHUNK_FWD, _CHUNK_BWD, _GDR_CHUNK_GPU_PRIORITY, "_chunk"),
    ("multi_head_latent_attention", "multi_head_latent_attention",
     "ejkernel_triton.multi_head_latent_attention:MlaDecodeParams",
     "ejkernel_triton.multi_head_latent_attention:MlaBwdParams", _MLA_GPU_PRIORITY, ""),
)  # fmt: skip


@hookimpl
def ejkernel_register_kernels(registry) -> None:  # noqa: ANN001
    interpret = os.environ.get("EJKERNEL_TRITON_INTERPRET") == "1"  # tests on CPU run the interpreter
    _register_flash_attention(registry, "gpu", 100, "triton")
    _register_attention_block(registry, "gpu", 100, "triton")
    if interpret:
        _register_flash_attention(registry, "cpu", 1, "triton_interpret")
        _register_attention_block(registry, "cpu", 1, "triton_interpret")
    for op, module, fwd, bwd, priority, suffix in _KERNELS:
        _register(registry, "gpu", priority, f"triton{suffix}", op, module, fwd, bwd)
        if interpret:
            _register(registry, "cpu", 1, f"triton{suffix}_interpret", op, module, fwd, bwd)


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
