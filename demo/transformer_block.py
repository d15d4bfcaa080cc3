"""A pre-norm transformer block on CPU whose attention is ``ejkernel.modules.flash_attention``.

It runs the block forward and backward (``jax.value_and_grad`` under ``jax.jit``) on small random
parameters, checks the attention against ejkernel's float32 reference, and prints which
implementation and launch parameters ejkernel chose for the forward and the backward pass, and why.

    nox -s demo                           # installs ejkernel-core and ejkernel-xla, then runs this
    python demo/transformer_block.py      # in an environment that has them

Shapes: B batch, T sequence length, C model width, H query heads, K key/value heads (grouped-query
attention: every K-th query head shares one key/value head), D head dim, F MLP width.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp

import ejkernel.ops
from ejkernel.modules import flash_attention
from ejkernel.testing.reference import flash_attention as reference_attention

B, T, C, H, K, F = 2, 128, 128, 8, 2, 512
D = C // H

Params = dict[str, jax.Array]


def init_params(key: jax.Array) -> Params:
    """Small random weights (scaled by fan-in) and unit norms."""
    shapes = {
        "wq": (C, H * D),
        "wk": (C, K * D),
        "wv": (C, K * D),
        "wo": (H * D, C),
        "w_up": (C, F),
        "w_down": (F, C),
    }
    keys = jax.random.split(key, len(shapes))
    params = {
        name: jax.random.normal(k, shape, jnp.float32) / shape[0] ** 0.5
        for k, (name, shape) in zip(keys, shapes.items(), strict=True)
    }
    params["norm_attn"] = jnp.ones((C,), jnp.float32)
    params["norm_mlp"] = jnp.ones((C,), jnp.float32)
    return params


def rms_norm(x: jax.Array, scale: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def qkv(params: Params, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``[B, T, C]`` -> query ``[B, T, H, D]``, key and value ``[B, T, K, D]``."""
    h = rms_norm(x, params["norm_attn"])
    q = (h @ params["wq"]).reshape(B, T, H, D)
    k = (h @ params["wk"]).reshape(B, T, K, D)
    v = (h @ params["wv"]).reshape(B, T, K, D)
    return q, k, v


def block(params: Params, x: jax.Array) -> jax.Array:
    """``x + attention(norm(x))``, then ``+ mlp(norm(.))``; ``[B, T, C]`` -> ``[B, T, C]``."""
    q, k, v = qkv(params, x)
    attn = flash_attention(q, k, v, causal=True)  # [B, T, H, D]; ejkernel picks the implementation
    x = x + attn.reshape(B, T, H * D) @ params["wo"]
    h = rms_norm(x, params["norm_mlp"])
    return x + jax.nn.gelu(h @ params["w_up"]) @ params["w_down"]


def loss_fn(params: Params, x: jax.Array, target: jax.Array) -> jax.Array:
    return jnp.mean((block(params, x) - target) ** 2)


def global_norm(tree: Any) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(tree)))


def main() -> None:
    k_params, k_x, k_target = jax.random.split(jax.random.key(0), 3)
    params = init_params(k_params)
    x = jax.random.normal(k_x, (B, T, C), jnp.float32)
    target = jax.random.normal(k_target, (B, T, C), jnp.float32)
    print(f"transformer block: B={B} T={T} C={C} H={H} K={K} (GQA) D={D} F={F}, on {jax.devices()[0].device_kind}")

    # Correctness first: the chosen implementation against the float32 reference, on this block's inputs.
    q, k, v = qkv(params, x)
    error = jnp.max(jnp.abs(flash_attention(q, k, v, causal=True) - reference_attention(q, k, v, causal=True)))
    print(f"attention vs reference: max |difference| = {float(error):.2e}")
    assert float(error) < 1e-4, error

    step = jax.jit(jax.value_and_grad(loss_fn))
    seen = len(ejkernel.ops.last_selections())
    start = time.perf_counter()
    loss, grads = jax.block_until_ready(step(params, x, target))
    seconds = time.perf_counter() - start
    print(
        f"loss {float(loss):.6f}   gradient norm {float(global_norm(grads)):.6f}   "
        f"(forward + backward, compiled and run in {seconds:.2f} s)"
    )

    # Tracing the step resolved flash_attention's config twice: "fwd" picked the implementation and its
    # forward launch parameters, "bwd" (asked because the call is differentiated) the backward's.
    print("\nwhat ejkernel chose for the training step (ejkernel.ops.last_selections()):")
    for sel in ejkernel.ops.last_selections()[seen:]:
        params_set = sel.params.to_dict() if sel.params is not None else {}
        print(
            f"  {sel.op} {sel.stage}: {sel.impl.name} from {sel.impl.plugin}, params {params_set or 'defaults'}, "
            f"decided by the {sel.tier} tier"
        )
        for reason in sel.why:
            print(f"      because: {reason}")
    if ejkernel.ops.autotune_policy() != "autotune":
        print("\nEJKERNEL_AUTOTUNE_POLICY=autotune times every candidate instead (EJKERNEL_LOG_AUTOTUNE=1 shows them).")


if __name__ == "__main__":
    main()
