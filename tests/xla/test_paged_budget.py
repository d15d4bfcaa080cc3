"""The XLA serving kernels' step budget: small steps on a CPU, few large ones on an accelerator."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ejkernel.ops import Invocation

from ejkernel_xla import page_attention, ragged_decode_attention
from ejkernel_xla._paged import ACCELERATOR_BUDGET, CPU_BUDGET, budget_for, choose_blocks


def test_budget_follows_the_backend():
    assert budget_for("cpu") is CPU_BUDGET and budget_for("gpu") is budget_for("tpu") is ACCELERATOR_BUDGET
    # The serving issue's decode shape (64 sequences of 4096 keys, H32 K8 D128, pages of 16): on a GPU all 64
    # sequences per step, two steps of 2048 keys; on a CPU steps of 8 sequences x 128 keys.
    assert choose_blocks(64, 1, 32, 8, 128, 4096, 16, ACCELERATOR_BUDGET) == (2048, 64)
    assert choose_blocks(64, 1, 32, 8, 128, 4096, 16) == (128, 8)


def test_heuristic_and_candidates_use_the_invocations_backend():
    arrays = {
        "query": jax.ShapeDtypeStruct((64, 32, 128), jnp.bfloat16),
        "key_cache": jax.ShapeDtypeStruct((64 * 256, 16, 8, 128), jnp.bfloat16),
        "value_cache": jax.ShapeDtypeStruct((64 * 256, 16, 8, 128), jnp.bfloat16),
        "context_lens": jax.ShapeDtypeStruct((64,), jnp.int32),
        "block_tables": jax.ShapeDtypeStruct((64, 256), jnp.int32),
    }
    gpu = page_attention.heuristic_cfg(Invocation.create("page_attention", arrays, backend="gpu"), "fwd")
    cpu = page_attention.heuristic_cfg(Invocation.create("page_attention", arrays, backend="cpu"), "fwd")
    assert (gpu.keys_per_block, gpu.seqs_per_chunk) == (2048, 64)
    assert (cpu.keys_per_block, cpu.seqs_per_chunk) == (128, 8)
    candidates = page_attention.candidate_cfgs(Invocation.create("page_attention", arrays, backend="gpu"), "fwd")
    assert gpu in candidates and max(c.keys_per_block for c in candidates) == 4096
    dense = {
        "query": arrays["query"],
        "key": jax.ShapeDtypeStruct((64, 4096, 8, 128), jnp.bfloat16),
        "value": jax.ShapeDtypeStruct((64, 4096, 8, 128), jnp.bfloat16),
        "sequence_start": arrays["context_lens"],
        "sequence_end": arrays["context_lens"],
    }
    inv = Invocation.create("ragged_decode_attention", dense, backend="gpu")
    assert ragged_decode_attention.heuristic_cfg(inv, "fwd").rows_per_chunk == 64
