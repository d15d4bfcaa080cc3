"""GPU check of the Triton ``ragged_page_attention`` (decode rows + flash-style prefill tiles) on an H200.

(a) correctness against ``ejkernel.testing.reference.ragged_page_attention`` (float32, computed piecewise: the decode
    sequences in one call, each prefill sequence in its own), max relative error and PASS/FAIL per case;
(b) timings (median of 20 after warmup, ``jax.block_until_ready``) of ``ejkernel.modules.ragged_page_attention``
    with ``platform="triton"`` and ``platform="xla"``: the mixed batch (48 decode rows + 4 prefills of 512 rows, all
    at 4096 context), the prefill-only batch (4 x 512 at 4096), the decode-only batch (48 x 1 at 4096), and the
    Triton flash forward on the same prefill (B4 T512 S4096, causal bottom-right) as the baseline.

Prefill TFLOP/s count the keys each row attends: 4 * H * D * sum over rows of (kv_len - q_len + r + 1), i.e.
4 * rows * context * H * D with the causal triangle within the new tokens halved (the flash forward's causal
count for T=512, S=4096). Decode GB/s count the K and V bytes of the decode rows' contexts.

Shapes: H32 K8 D128 bf16, page 16. Run (on the GPU machine, repo root):
    bash .ci/gpu setup >/dev/null && PYTHONPATH=/tmp/ejk-site python3 .venv/gpucheck/ragged_prefill.py [--sweep]
``--no-check`` skips (a); ``--sweep`` also times the prefill-only batch under each prefill launch the autotuner would try.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from _timing import median_ms  # benchmarks/gpucheck/_timing.py (the script's folder is on sys.path)

import ejkernel  # noqa: F401
from ejkernel.modules import RaggedPageAttentionConfig, flash_attention, ragged_page_attention
from ejkernel.testing import reference

from ejkernel_triton.ragged_page_attention import RaggedPageParams

H, K, D, PAGE, CTX = 32, 8, 128, 16, 4096
MIXED = tuple((1, CTX) for _ in range(48)) + tuple((512, CTX) for _ in range(4))
PREFILL = tuple((512, CTX) for _ in range(4))
DECODE = tuple((1, CTX) for _ in range(48))
TRITON = "triton"  # the implementation's name ("triton_interpret" on a CPU with EJKERNEL_TRITON_INTERPRET=1)


def build(seqs, *, h=None, k=None, d=None, dv=None, dtype=jnp.bfloat16, pad_rows=8, seed=0):
    """A ragged batch on a paged cache with shuffled pages (one spare slot, ``pad_rows`` padding rows)."""
    rng = np.random.default_rng(seed)
    h, k, d = h or H, k or K, d or D
    dv = dv or d
    lens = [kv for _, kv in seqs]
    used = [-(-n // PAGE) for n in lens]
    m = max(used) + 1
    num_pages = sum(used) + 7
    order = rng.permutation(num_pages)
    tables = np.full((len(seqs) + 1, m), num_pages + 3, np.int32)  # unused entries: out of range
    at = 0
    for s, u in enumerate(used):
        tables[s, :u] = order[at : at + u]
        at += u
    q_lens = [q for q, _ in seqs]
    t = sum(q_lens) + pad_rows
    cu = np.concatenate([[0], np.cumsum(q_lens), [t + 5]]).astype(np.int32)
    key = jax.random.key(seed)
    k1, k2, k3 = jax.random.split(key, 3)
    q = jax.random.normal(k1, (t, h, d), jnp.float32).astype(dtype)
    kc = jax.random.normal(k2, (num_pages, PAGE, k, d), jnp.float32).astype(dtype)
    vc = jax.random.normal(k3, (num_pages, PAGE, k, dv), jnp.float32).astype(dtype)
    kv = np.array(lens + [99999], np.int32)
    return (q, kc, vc, jnp.asarray(kv), jnp.asarray(tables), jnp.asarray(cu), jnp.array([len(seqs)], jnp.int32))


def reference_piecewise(args, seqs, **opts):
    """The float32 reference: the decode sequences in one call, each longer sequence alone."""
    q, kc, vc, kv, tables, cu, _ = args
    kc32, vc32 = kc.astype(jnp.float32), vc.astype(jnp.float32)
    cu_np = np.asarray(cu)
    out = np.zeros((q.shape[0], q.shape[1], vc.shape[-1]), np.float32)
    fn = jax.jit(lambda *a: reference.ragged_page_attention(*a, **opts))
    dec = [s for s, (ql, _) in enumerate(seqs) if ql == 1]
    groups = ([dec] if dec else []) + [[s] for s, (ql, _) in enumerate(seqs) if ql > 1]
    for group in groups:
        rows = np.concatenate([np.arange(cu_np[s], cu_np[s + 1]) for s in group])
        sizes = [int(cu_np[s + 1] - cu_np[s]) for s in group]
        sub_cu = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
        got = fn(
            q[rows].astype(jnp.float32),
            kc32,
            vc32,
            kv[np.array(group)],
            tables[np.array(group)],
            jnp.asarray(sub_cu),
            jnp.array([len(group)], jnp.int32),
        )
        out[rows] = np.asarray(got)
    return out


def check(name, seqs, *, tol=2e-2, **kw):
    opts = {k: kw.pop(k) for k in ("sliding_window", "logits_soft_cap") if k in kw}
    args = build(seqs, **kw)
    got = jax.jit(lambda *a: ragged_page_attention(*a, platform=TRITON, **opts))(*args)
    got = np.asarray(got.astype(jnp.float32))
    want = reference_piecewise(args, seqs, **opts)
    live = int(np.asarray(args[5])[len(seqs)])
    err = np.abs(got[:live] - want[:live]).max() / max(np.abs(want[:live]).max(), 1e-30)
    norm = np.linalg.norm(got[:live] - want[:live]) / max(np.linalg.norm(want[:live]), 1e-30)
    pad_ok = bool(np.all(got[live:] == 0))
    ok = bool(np.isfinite(got).all() and err <= tol and norm <= 1.6e-2 and pad_ok)
    print(
        f"check {name}: max rel err {err:.3e} (norm rel {norm:.3e}), padding zeros {pad_ok}: {'PASS' if ok else 'FAIL'}"
    )
    return ok


def prefill_flops(seqs):
    keys = sum(sum(kv - ql + r + 1 for r in range(ql)) for ql, kv in seqs if ql > 1)
    return 4.0 * H * D * keys


def decode_bytes(seqs, e=2):
    return float(sum(kv for ql, kv in seqs if ql == 1) * K * D * 2 * e)


def rpa(platform, fwd_params=None):
    cfg = None if fwd_params is None else RaggedPageAttentionConfig(platform=platform, fwd_params=fwd_params)
    kw = {"cfg": cfg} if cfg is not None else {"platform": platform}
    return jax.jit(lambda *a: ragged_page_attention(*a, **kw))


def main():
    print(jax.devices()[0].device_kind, "jax", jax.__version__)
    t0 = time.time()
    ok = True
    if "--no-check" not in sys.argv:
        ok &= check("mixed 48x1 + 4x512 @4096 bf16", MIXED)
        small = tuple((1, 100 + 97 * i) for i in range(6)) + ((200, 700), (333, 333), (3, 1000))
        ok &= check("small, window 256, soft cap 30", small, sliding_window=256, logits_soft_cap=30.0, seed=1)
    print(f"checks {'PASS' if ok else 'FAIL'} ({time.time() - t0:.0f} s)")

    results = {}
    for name, seqs in (("mixed", MIXED), ("prefill", PREFILL), ("decode", DECODE)):
        args = build(seqs, pad_rows=0)
        for platform in (TRITON, "xla"):
            ms = median_ms(rpa(platform), *args)
            results[name, platform] = ms
            line = f"{name:8s} {platform:6s} {ms:8.3f} ms"
            if name == "prefill":
                line += f"  prefill {prefill_flops(seqs) / ms / 1e9:6.1f} TFLOP/s"
            if name == "decode":
                line += f"  decode {decode_bytes(seqs) / ms / 1e6:6.0f} GB/s (K+V bytes)"
            if name == "mixed":
                line += f"  prefill {prefill_flops(seqs) / ms / 1e9:6.1f} TFLOP/s over the whole call"
            print(line, flush=True)
    for platform in (TRITON, "xla"):
        mixed, dec = results["mixed", platform], results["decode", platform]
        print(f"mixed {platform}: minus the decode-only time ({dec:.3f} ms) the prefill rows run at "
              f"{prefill_flops(MIXED) / max(mixed - dec, 1e-6) / 1e9:.1f} TFLOP/s")  # fmt: skip

    kq, kk, kv_ = jax.random.split(jax.random.key(3), 3)
    fq = jax.random.normal(kq, (len(PREFILL), PREFILL[0][0], H, D), jnp.bfloat16)
    fk = jax.random.normal(kk, (len(PREFILL), CTX, K, D), jnp.bfloat16)
    fv = jax.random.normal(kv_, (len(PREFILL), CTX, K, D), jnp.bfloat16)
    flash = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=True, platform=TRITON))
    ms = median_ms(flash, fq, fk, fv)
    base = prefill_flops(PREFILL) / ms / 1e9
    print(f"flash_attention {TRITON} B{len(PREFILL)} T{PREFILL[0][0]} S{CTX} causal: {ms:.3f} ms, {base:.1f} TFLOP/s; prefill-only ratio "
          f"{prefill_flops(PREFILL) / results['prefill', TRITON] / 1e9 / base:.2f}x (goal >= 0.6)")  # fmt: skip

    if "--sweep" in sys.argv:
        from ejkernel_triton.ragged_page_attention.interface import _prefill_candidates

        args = build(PREFILL, pad_rows=0)
        for plan in _prefill_candidates(args[0].shape[0], H // K, D, D, 2):
            params = RaggedPageParams(
                prefill_block_m=plan.block_m,
                prefill_block_n=plan.block_n,
                prefill_num_warps=plan.num_warps,
                prefill_num_stages=plan.num_stages,
            )
            try:
                ms = median_ms(rpa(TRITON, params), *args, n=10, warmup=2)
                print(f"sweep {plan}: {ms:.3f} ms, {prefill_flops(PREFILL) / ms / 1e9:.1f} TFLOP/s", flush=True)
            except Exception as e:  # a launch that fails to compile: say so, go on
                print(f"sweep {plan}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    print(f"total {time.time() - t0:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
