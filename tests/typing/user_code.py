"""A user's project, as mypy sees it (the lint session type-checks this file; it is never run).

The calls marked ``# type: ignore[...]`` are wrong on purpose: with ``warn_unused_ignores`` mypy fails
when it does not flag them, so this file checks that the annotations reject bad calls as well as that
they accept good ones. ``py.typed`` ships with every distribution, so a user's mypy sees the same.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.kernels import Backend, Platform, kernel_registry
from ejkernel.modules import FlashAttentionConfig, flash_attention, gla, grouped_matmul, page_attention
from ejkernel.ops import FwdParams

q = jnp.zeros((2, 128, 8, 64), jnp.bfloat16)
k = jnp.zeros((2, 128, 2, 64), jnp.bfloat16)

out: jax.Array = flash_attention(q, k, k, causal=True)
out = flash_attention(q, k, k, causal=True, sliding_window=(64, 0), softmax_scale=0.125, platform="xla")
out = flash_attention(q, k, k, cfg=FlashAttentionConfig(fwd_params=FwdParams(q_blocksize=64), platform="xla"))
out = flash_attention(np.zeros((2, 16, 8, 64), np.float32), k, k)  # NumPy arrays are accepted

o, state = gla(q, q, q, q, output_final_state=True)
first: jax.Array = o
y: jax.Array = grouped_matmul(jnp.zeros((64, 32)), jnp.zeros((4, 32, 16)), jnp.array([16, 16, 16, 16], jnp.int32))
impl = kernel_registry.get(algorithm="flash_attention", platform=Platform.XLA, backend=Backend.ANY)

flash_attention(q, k, k, causal="yes")  # type: ignore[arg-type]
flash_attention(q, k, k, casual=True)  # type: ignore[call-arg]
flash_attention(q, k)  # type: ignore[call-arg]
page_attention(q, k, k)  # type: ignore[call-arg]
wrong: str = flash_attention(q, k, k)  # type: ignore[assignment]
