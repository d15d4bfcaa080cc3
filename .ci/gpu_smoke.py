"""A short GPU check of every flash attention implementation after a core change: forward and gradients
against the float32 reference at a realistic shape (many blocks, GQA, an odd length), bf16.

    PYTHONPATH=<site> python3 .ci/gpu_smoke.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np


def rel(a, b) -> float:  # noqa: ANN001
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu_smoke.json")
    parser.add_argument("--causal", default="0,1", help="comma-separated 0/1: which masks to check")
    args = parser.parse_args()
    from ejkernel.modules import flash_attention
    from ejkernel.ops import last_selections
    from ejkernel.testing import reference

    b, t, h, k, d = 2, 1031, 8, 2, 128
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, t, h, d), jnp.bfloat16)
    kk = jax.random.normal(keys[1], (b, t, k, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, t, k, d), jnp.bfloat16)
    do = jax.random.normal(keys[3], (b, t, h, d), jnp.bfloat16)
    rows = []
    for causal in [bool(int(c)) for c in args.causal.split(",")]:
        f32 = [x.astype(jnp.float32) for x in (q, kk, v)]
        want, vjp = jax.vjp(lambda *a, c=causal: reference.flash_attention(*a, causal=c), *f32)
        want_g = vjp(do.astype(jnp.float32))
        for name in ("xla", "cudnn", "triton", "mosaic_gpu"):
            row = {"impl": name, "causal": causal, "shape": [b, t, h, k, d], "dtype": "bfloat16"}
            try:
                t0 = time.perf_counter()
                fn = jax.jit(lambda q, k, v, c=causal, n=name: flash_attention(q, k, v, causal=c, platform=n))
                out, vjp_k = jax.vjp(fn, q, kk, v)
                got_g = vjp_k(do)
                sel = [s for s in last_selections() if s.op == "flash_attention"][-1]
                row.update(
                    ran=sel.impl.name,
                    fwd_rel=rel(out, want),
                    grad_rel=[rel(g, w) for g, w in zip(got_g, want_g)],
                    seconds=round(time.perf_counter() - t0, 2),
                )
                row["ok"] = row["fwd_rel"] < 2e-2 and max(row["grad_rel"]) < 5e-2
            except Exception as e:  # a declined call (e.g. cuDNN with an odd length) is a result too
                row.update(ok=None, error=f"{type(e).__name__}: {str(e)[:300]}")
            rows.append(row)
            print(json.dumps(row), flush=True)
    # Forward-mode on the GPU kernels' path: jvp goes through the reference's tangent.
    tangent = jax.jvp(lambda q: flash_attention(q, kk, v, causal=True, platform="triton"), (q,), (do,))[1]
    want_t = jax.jvp(lambda q: reference.flash_attention(q, kk, v, causal=True), (q,), (do,))[1]
    rows.append({"impl": "triton", "check": "jvp", "rel": rel(tangent, want_t), "ok": rel(tangent, want_t) < 2e-2})
    print(json.dumps(rows[-1]), flush=True)
    from ejkernel.device import device_info

    info = device_info()
    doc = {"device": str(info), "jax": jax.__version__, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    bad = [r for r in rows if r.get("ok") is False]
    print(f"{len(rows)} rows, {len(bad)} failed")


if __name__ == "__main__":
    main()
