"""The references as a plugin: platform ``reference`` on every backend, at the lowest priority.

Tests that exercise the core (dispatch, caching, sharding, the CLI) register it so that they run
with the core alone, whatever plugins are installed:

>>> from ejkernel.plugins import register_plugin, unregister_plugin
>>> register_plugin(ReferencePlugin(), "reference")
>>> import jax.numpy as jnp
>>> from ejkernel.modules import flash_attention
>>> flash_attention(jnp.ones((1, 4, 2, 8)), jnp.ones((1, 4, 1, 8)), jnp.ones((1, 4, 1, 8)), platform="reference").shape
(1, 4, 2, 8)
>>> unregister_plugin("reference")
"""

from __future__ import annotations

from typing import Any

from ejkernel.plugins import BackendInfo, hookimpl
from ejkernel.testing import reference


def flash_attention(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    *,
    attention_mask: Any = None,
    q_segment_ids: Any = None,
    kv_segment_ids: Any = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    dropout_prob: float = 0.0,
    dropout_seed: Any = None,
    cu_seqlens_q: Any = None,
    cu_seqlens_k: Any = None,
    fwd_params: Any = None,
    bwd_params: Any = None,
) -> Any:
    """The reference ``flash_attention`` behind the canonical signature (launch parameters are ignored)."""
    return reference.flash_attention(
        query, key, value, bias, attention_mask=attention_mask, q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids, softmax_scale=softmax_scale, causal=causal, sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap, dropout_prob=dropout_prob, dropout_seed=dropout_seed,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
    )  # fmt: skip


class ReferencePlugin:
    """Registers every reference as an implementation (platform ``reference``, backend ``any``, priority -1000)."""

    @hookimpl
    def ejkernel_register_kernels(self, registry: Any) -> None:
        registry.register("flash_attention", "reference", "any", priority=-1000, impl=flash_attention, version="0")

    @hookimpl
    def ejkernel_backend_info(self) -> BackendInfo:
        return BackendInfo(name="ejkernel reference", version="0", platforms=("reference",), available=True)
