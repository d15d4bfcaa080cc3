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
        name="xla",
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
        name="cudnn",
        impl="ejkernel_xla.flash_attention.cudnn:flash_attention",
        supports="ejkernel_xla.flash_attention.cudnn:supports",
        heuristic_cfg="ejkernel_xla.flash_attention.cudnn:heuristic_cfg",
        version=__version__,
    )
    registry.register(
        "multi_head_latent_attention",
        "xla",
        "any",
        priority=10,
        name="xla",
        impl="ejkernel_xla.multi_head_latent_attention:multi_head_latent_attention",
        heuristic_cfg="ejkernel_xla.multi_head_latent_attention:heuristic_cfg",
        candidate_cfgs="ejkernel_xla.multi_head_latent_attention:candidate_cfgs",
        version=__version__,
    )
    registry.register(
        "ring_attention",
        "xla",
        "any",
        priority=10,
        name="xla",
        impl="ejkernel_xla.ring_attention:ring_attention",
        heuristic_cfg="ejkernel_xla.ring_attention:heuristic_cfg",
        candidate_cfgs="ejkernel_xla.ring_attention:candidate_cfgs",
        version=__version__,
    )
    registry.register(
        "page_attention",
        "xla",
        "any",
        priority=10,
        name="xla",
        impl="ejkernel_xla.page_attention:page_attention",
        heuristic_cfg="ejkernel_xla.page_attention:heuristic_cfg",
        candidate_cfgs="ejkernel_xla.page_attention:candidate_cfgs",
        fwd_params="ejkernel_xla.params:PagedParams",
        bwd_params="ejkernel_xla.params:NoParams",
        version=__version__,
    )
    registry.register(
        "ragged_page_attention",
        "xla",
        "any",
        priority=10,
        name="xla",
        impl="ejkernel_xla.ragged_page_attention:ragged_page_attention",
        heuristic_cfg="ejkernel_xla.ragged_page_attention:heuristic_cfg",
        candidate_cfgs="ejkernel_xla.ragged_page_attention:candidate_cfgs",
        fwd_params="ejkernel_xla.params:RaggedPagedParams",
        bwd_params="ejkernel_xla.params:NoParams",
        version=__version__,
    )
    registry.register(
        "ragged_decode_attention",
        "xla",
        "any",
        priority=10,
        name="xla",
        impl="ejkernel_xla.ragged_decode_attention:ragged_decode_attention",
        heuristic_cfg="ejkernel_xla.ragged_decode_attention:heuristic_cfg",
        candidate_cfgs="ejkernel_xla.ragged_decode_attention:candidate_cfgs",
        fwd_params="ejkernel_xla.params:RaggedDecodeParams",
        bwd_params="ejkernel_xla.params:NoParams",
        version=__version__,
    )
    registry.register(
        "attention",
        "xla",
        "any",
        priority=10,
        name="xla",
        impl="ejkernel_xla.attention:attention",
        heuristic_cfg="ejkernel_xla.attention:heuristic_cfg",
        fwd_params="ejkernel_xla.params:NoParams",
        bwd_params="ejkernel_xla.params:NoParams",
        version=__version__,
    )
    registry.register(
        "scaled_dot_product_attention",
        "xla",
        "any",
        priority=10,
        name="xla",
        impl="ejkernel_xla.scaled_dot_product_attention:scaled_dot_product_attention",
        heuristic_cfg="ejkernel_xla.scaled_dot_product_attention:heuristic_cfg",
        candidate_cfgs="ejkernel_xla.scaled_dot_product_attention:candidate_cfgs",
        version=__version__,
    )
    # cuDNN through XLA on NVIDIA GPUs, above the blockwise kernel: the same fused kernel that
    # flash_attention's cuDNN path measured fastest on the H200 (BENCHMARKS.md); supports() declines
    # what cuDNN cannot do as the contract says. Under the autotune policy timing decides.
    registry.register(
        "scaled_dot_product_attention",
        "xla",
        "gpu",
        priority=150,
        name="cudnn",
        impl="ejkernel_xla.scaled_dot_product_attention.cudnn:scaled_dot_product_attention",
        supports="ejkernel_xla.scaled_dot_product_attention.cudnn:supports",
        heuristic_cfg="ejkernel_xla.scaled_dot_product_attention.cudnn:heuristic_cfg",
        version=__version__,
    )
    registry.register(
        "block_sparse_attention",
        "xla",
        "any",
        priority=10,
        name="xla",
        impl="ejkernel_xla.block_sparse_attention:block_sparse_attention",
        heuristic_cfg="ejkernel_xla.block_sparse_attention:heuristic_cfg",
        candidate_cfgs="ejkernel_xla.block_sparse_attention:candidate_cfgs",
        version=__version__,
    )
    registry.register(
        "native_sparse_attention",
        "xla",
        "any",
        priority=10,
        name="xla",
        impl="ejkernel_xla.native_sparse_attention:native_sparse_attention",
        heuristic_cfg="ejkernel_xla.native_sparse_attention:heuristic_cfg",
        candidate_cfgs="ejkernel_xla.native_sparse_attention:candidate_cfgs",
        version=__version__,
    )
    registry.register(
        "gated_delta_rule",
        "xla",
        "any",
        priority=10,
        name="xla",
        impl="ejkernel_xla.gated_delta_rule:gated_delta_rule",
        heuristic_cfg="ejkernel_xla.gated_delta_rule:heuristic_cfg",
        candidate_cfgs="ejkernel_xla.gated_delta_rule:candidate_cfgs",
        fwd_params="ejkernel_xla.params:DeltaRuleParams",
        bwd_params="ejkernel_xla.params:DeltaRuleParams",
        version=__version__,
    )
    registry.register(
        "mean_pooling",
        "xla",
        "any",
        priority=10,
        name="xla",
        impl="ejkernel_xla.mean_pooling:mean_pooling",
        fwd_params="ejkernel_xla.params:NoParams",
        bwd_params="ejkernel_xla.params:NoParams",
        version=__version__,
    )
    registry.register(
        "grouped_matmul",
        "xla",
        "any",
        priority=10,
        name="xla",
        impl="ejkernel_xla.grouped_matmul:grouped_matmul",
        heuristic_cfg="ejkernel_xla.grouped_matmul:heuristic_cfg",
        candidate_cfgs="ejkernel_xla.grouped_matmul:candidate_cfgs",
        fwd_params="ejkernel_xla.params:TiledGmmParams",
        bwd_params="ejkernel_xla.params:TiledGmmParams",
        version=__version__,
    )
    # jax.lax.ragged_dot on TPU, which XLA lowers to its native grouped matmul; elsewhere its generic
    # lowering masks a copy of lhs per group, and the tiled loop above was 35x faster on CPU.
    registry.register(
        "grouped_matmul",
        "xla",
        "tpu",
        priority=20,
        name="ragged_dot",
        impl="ejkernel_xla.grouped_matmul.ragged:grouped_matmul",
        fwd_params="ejkernel_xla.params:NoParams",
        bwd_params="ejkernel_xla.params:NoParams",
        version=__version__,
    )
    registry.register(
        "gla",
        "xla",
        "any",
        priority=10,
        name="xla",
        impl="ejkernel_xla.gla:gla",
        heuristic_cfg="ejkernel_xla.gla:heuristic_cfg",
        candidate_cfgs="ejkernel_xla.gla:candidate_cfgs",
        fwd_params="ejkernel_xla.params:ChunkParams",
        bwd_params="ejkernel_xla.params:ChunkParams",
        version=__version__,
    )
    registry.register(
        "lightning_attn",
        "xla",
        "any",
        priority=10,
        name="xla",
        impl="ejkernel_xla.lightning_attn:lightning_attn",
        heuristic_cfg="ejkernel_xla.lightning_attn:heuristic_cfg",
        candidate_cfgs="ejkernel_xla.lightning_attn:candidate_cfgs",
        fwd_params="ejkernel_xla.params:ChunkParams",
        bwd_params="ejkernel_xla.params:ChunkParams",
        version=__version__,
    )
    registry.register(
        "recurrent",
        "xla",
        "any",
        priority=10,
        name="xla",
        impl="ejkernel_xla.recurrent:recurrent",
        heuristic_cfg="ejkernel_xla.recurrent:heuristic_cfg",
        candidate_cfgs="ejkernel_xla.recurrent:candidate_cfgs",
        fwd_params="ejkernel_xla.params:ChunkParams",
        bwd_params="ejkernel_xla.params:ChunkParams",
        version=__version__,
    )
    # The attention-block contract (forward and backward, two ops) that the core's schedules call: the
    # blockwise kernel on intervals of admitted keys. The backward op's one stage takes BwdParams.
    registry.register(
        "flash_attention_block",
        "xla",
        "any",
        priority=10,
        name="xla",
        impl="ejkernel_xla.flash_attention.block:flash_attention_block",
        heuristic_cfg="ejkernel_xla.flash_attention.block:heuristic_cfg",
        candidate_cfgs="ejkernel_xla.flash_attention.block:candidate_cfgs",
        version=__version__,
    )
    registry.register(
        "flash_attention_block_bwd",
        "xla",
        "any",
        priority=10,
        name="xla",
        impl="ejkernel_xla.flash_attention.block:flash_attention_block_bwd",
        heuristic_cfg="ejkernel_xla.flash_attention.block:bwd_heuristic_cfg",
        candidate_cfgs="ejkernel_xla.flash_attention.block:bwd_candidate_cfgs",
        fwd_params="ejkernel.kernels.params:BwdParams",
        version=__version__,
    )
    # (one registration per op above this line, in the order of the catalogue)


@hookimpl
def ejkernel_backend_info() -> BackendInfo:
    return BackendInfo(name="ejkernel-xla", version=__version__, platforms=("xla",), available=True)
