"""What the linear-attention ``Kernel``s (``gla``, ``lightning_attn``, ``recurrent``) share."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ejkernel.ops import Invocation


def normalize_scale(arguments: dict[str, Any]) -> dict[str, Any]:
    """``scale=None`` and ``scale=K ** -0.5`` are the same call (one cache entry)."""
    d = arguments["q"].shape[-1]
    arguments["scale"] = float(d**-0.5 if arguments["scale"] is None else arguments["scale"])
    return arguments


def timing_inputs(inputs: dict[str, Any], inv: Invocation, gates: tuple[str, ...]) -> dict[str, Any]:
    """Make random timing inputs representative: log-decay ``gates`` in GLA's usual range
    (``log_sigmoid(x) / 16``), a non-negative ``slope``, and packed sequences of equal length."""
    jnp = jax.numpy
    for name in gates:
        if name in inputs:
            x = inputs[name].astype(jnp.float32)
            inputs[name] = (jax.nn.log_sigmoid(x) / 16).astype(inputs[name].dtype)
    if "slope" in inputs:
        inputs["slope"] = (0.1 * jnp.abs(inputs["slope"].astype(jnp.float32))).astype(inputs["slope"].dtype)
    cu = inv.arguments.get("cu_seqlens")
    if isinstance(cu, jax.ShapeDtypeStruct):
        n, t = cu.shape[0] - 1, inv.arguments["q"].shape[1]
        inputs["cu_seqlens"] = jnp.asarray(np.linspace(0, t, n + 1).astype(np.int64), cu.dtype)
    return inputs
