"""One forward+backward of the chunked Triton ``gla``, ``gated_delta_rule`` and ``recurrent`` with a value gate (B4 T4096 H16 K=V=128 bf16, the
linear-attention issue's shape), for a kernel-by-kernel profile under Nsight Compute on the GPU machine:

    bash .ci/gpu setup >/dev/null && PYTHONPATH=/tmp/ejk-site ncu --clock-control none \
        --metrics gpu__time_duration.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active \
        -k regex:'chunk_|delta_|value_' --csv python3 benchmarks/gpucheck/linear_profile.py [gla|gdr|value] [--shape B,T]

Each function runs twice (the first compiles); take the second launch of each kernel. ``--small``: tiny shapes (a
dry run on a CPU with EJKERNEL_TRITON_INTERPRET=1).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.modules import gated_delta_rule, gla, recurrent

SMALL = "--small" in sys.argv
B, T, H, K, V = (1, 64, 2, 32, 32) if SMALL else (4, 4096, 16, 128, 128)
if "--shape" in sys.argv:  # B,T
    B, T = (int(x) for x in sys.argv.pop(sys.argv.index("--shape") + 1).split(","))


def main() -> None:
    rng = np.random.default_rng(0)
    bf = jnp.bfloat16
    q, k = (jnp.asarray(rng.standard_normal((B, T, H, K)), bf) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((B, T, H, V)), bf)
    ct = jnp.asarray(rng.standard_normal((B, T, H, V)), jnp.float32)
    gk = jnp.asarray(-np.logaddexp(0.0, -rng.standard_normal((B, T, H, K))) / 16, jnp.float32)
    g = jnp.asarray(-jax.nn.softplus(-(rng.standard_normal((B, T, H)) + 3)), jnp.float32)
    beta = jnp.asarray(jax.nn.sigmoid(rng.standard_normal((B, T, H))), jnp.float32)
    gv = jnp.asarray(-np.logaddexp(0.0, -rng.standard_normal((B, T, H, V))) / 16, jnp.float32)
    which = [a for a in sys.argv[1:] if not a.startswith("--")] or ["gla", "gdr", "value"]

    def gla_loss(q, k, v, gk):
        out = gla(q, k, v, gk, platform="triton_chunk", backend="gpu")[0]
        return jnp.sum(out.astype(jnp.float32) * ct)

    def gdr_loss(q, k, v, g, beta):
        out = gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True, platform="triton_chunk", backend="gpu")[0]
        return jnp.sum(out.astype(jnp.float32) * ct)

    def value_loss(q, k, v, g, gv):
        out = recurrent(q, k, v, g=g, g_v=gv, platform="triton_value_chunk", backend="gpu")[0]
        return jnp.sum(out.astype(jnp.float32) * ct)

    runs = {
        "gla": (jax.jit(jax.grad(gla_loss, argnums=(0, 1, 2, 3))), (q, k, v, gk)),
        "gdr": (jax.jit(jax.grad(gdr_loss, argnums=(0, 1, 2, 3, 4))), (q, k, v, g, beta)),
        "value": (jax.jit(jax.grad(value_loss, argnums=(0, 1, 2, 3, 4))), (q, k, v, g, gv)),
    }
    for name in which:
        f, args = runs[name]
        for _ in range(2):
            jax.block_until_ready(f(*args))
        print(name, "done", flush=True)


if __name__ == "__main__":
    main()
