"""MLA decode on a GPU: the split-K kernel under several launch plans, and the transposed variant
(``MlaDecodeParams(transposed=True)``: scores computed as ``K Q^T``, the output accumulated transposed, one value block), each
checked against the float32 reference and timed (median of 20, ``jax.block_until_ready``). Also the XLA
``page_attention`` fallback at several key-block sizes and chunks, and without its value mask, against the naive
gather + dense attention.

Shapes: DeepSeek-V3 decode, B64 x 4096, H128 (and H16), Dl 512, Dr 64, page 64, bf16. TB/s count the latent
cache once plus Q and O (the bench's model). Run on the GPU machine after ``bash .ci/gpu setup``:
``PYTHONPATH=/tmp/ejk-site python3 benchmarks/gpucheck/mla_variants.py [xla] [mla] [split=R/N/DV/W/S/SP,...]
[t=R/N/W/S/SP,...] [heads=128,16]`` (the plans and head counts to time; the defaults are ``SPLIT_K`` and
``TRANSPOSED`` below, and both head counts). Under ``ncu -k regex:mla`` each plan's launches get their own times.
"""

from __future__ import annotations

import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.testing import reference

from ejkernel_triton.multi_head_latent_attention import interface as mla

B, L, DL, DR, P = 64, 4096, 512, 64, 64
# Plans (rows, keys, value dims, warps, stages, splits; all 0: the default) and transposed (rows, keys, warps, stages,
# splits); the command line may replace them: ``split=64/64/512/8/2/2,...`` and ``t=64/64/8/2/2,...``.
SPLIT_K = ((0, 0, 0, 0, 0, 0), (64, 64, 512, 8, 1, 2), (64, 64, 512, 8, 1, 4), (64, 32, 512, 8, 2, 2))
TRANSPOSED = ((64, 64, 8, 2, 2), (64, 64, 8, 1, 2), (32, 64, 4, 3, 2), (16, 64, 4, 3, 4))


def ms(f, *args):
    f = jax.jit(f)
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(20):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def transposed(q, kv, lens, tables, br, bn, warps, stages, splits):
    p = mla.MlaDecodeParams(br, bn, None, splits, warps, stages, transposed=True)
    return mla.multi_head_latent_attention(q, kv, block_tables=tables, cache_seqlens=lens, fwd_params=p)


def mla_case(h, split_k, transposed_plans):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, 1, h, DL + DR)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((B * L // P, P, DL + DR)), jnp.bfloat16)
    tables = jnp.asarray(rng.permutation(B * L // P).reshape(B, L // P), jnp.int32)
    lens = jnp.full((B,), L, jnp.int32)
    ref = reference.multi_head_latent_attention(
        q.astype(jnp.float32), kv.astype(jnp.float32), latent_dim=DL, block_tables=tables, cache_seqlens=lens
    )
    nbytes = B * L * (DL + DR) * 2 + B * h * (2 * DL + DR) * 2
    flops = 2 * B * h * L * (DL + DR + DL)

    def report(name, f):
        try:
            out = jax.jit(f)(q, kv, lens, tables)
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))
            t = ms(f, q, kv, lens, tables)
            ok = "PASS" if err < 2e-2 else "FAIL"
            print(
                f"H{h} {name:34s} {t:8.3f} ms {nbytes / t / 1e9:6.2f} TB/s {flops / t / 1e9:6.0f} TFLOP/s err {err:.1e} {ok}",
                flush=True,
            )
        except Exception as e:  # noqa: BLE001
            print(f"H{h} {name:34s} ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)

    for r, n, dv, w, st, sp in split_k:
        p = mla.MlaDecodeParams() if r == 0 else mla.MlaDecodeParams(r, n, dv, sp, w, st, transposed=False)
        label = "split-K default" if r == 0 else f"split-K r{r} n{n} dv{dv} w{w} s{st} sp{sp}"
        report(
            label,
            lambda q, kv, ln, tb, p=p: mla.multi_head_latent_attention(
                q, kv, block_tables=tb, cache_seqlens=ln, fwd_params=p
            ),
        )
    for br, bn, w, st, sp in transposed_plans:
        if br > h:
            continue
        report(f"transposed r{br} n{bn} w{w} s{st} sp{sp}",
               lambda q, kv, ln, tb, a=(br, bn, w, st, sp): transposed(q, kv, ln, tb, *a))  # fmt: skip


def paged_xla():
    from ejkernel_xla.page_attention.interface import page_attention
    from ejkernel_xla.params import PagedParams

    n, h, kh, d, page, ctx = 64, 32, 8, 128, 16, 4096
    rng = np.random.default_rng(1)
    pages = n * ctx // page
    q = jnp.asarray(rng.standard_normal((n, h, d)), jnp.bfloat16)
    kc = jnp.asarray(rng.standard_normal((pages, page, kh, d)), jnp.bfloat16)
    vc = jnp.asarray(rng.standard_normal((pages, page, kh, d)), jnp.bfloat16)
    tables = jnp.asarray(rng.permutation(pages).reshape(n, ctx // page), jnp.int32)
    lens = jnp.full((n,), ctx, jnp.int32)
    nbytes = 2 * n * ctx * kh * d * 2

    def gather(q, kc, vc, lens, tables):
        k = kc[tables].reshape(n, -1, kh, d)
        v = vc[tables].reshape(n, -1, kh, d)
        return jax.nn.dot_product_attention(q[:, None], k, v, key_value_seq_lengths=lens, implementation="xla")[:, 0]

    ref = gather(q.astype(jnp.float32), kc.astype(jnp.float32), vc.astype(jnp.float32), lens, tables)
    cases = [("gather + dot_product_attention", gather)]
    for kpb, spc in ((None, None), (4096, None), (4096, 64), (4096, 32), (2048, 32), (1024, 64)):
        p = PagedParams(keys_per_block=kpb, seqs_per_chunk=spc)
        cases.append(
            (f"xla kpb{kpb} spc{spc}", lambda q, kc, vc, ln, tb, p=p: page_attention(q, kc, vc, ln, tb, fwd_params=p))
        )
    cases.append(("gather + dot_product_attention (again)", gather))

    # The same XLA path without zeroing the values at positions that hold no key (the guard against stale cache
    # contents): does that select cost a pass over the gathered values?
    from ejkernel_xla import _paged

    def unmasked(*a):
        keep = _paged.update

        def update(o, state, q, k, v, allowed, key_ok):
            return keep(o, state, q, k, v, allowed, jnp.ones_like(key_ok))

        _paged.update = update
        try:
            return page_attention(*a)
        finally:
            _paged.update = keep

    cases += [("xla without the value mask", unmasked), ("xla default (again)", cases[1][1])]
    for name, f in cases:
        try:
            out = jax.jit(f)(q, kc, vc, lens, tables)
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
            t = ms(f, q, kc, vc, lens, tables)
            print(f"page_attention {name:34s} {t:8.3f} ms {nbytes / t / 1e9:6.2f} TB/s err {err:.1e}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"page_attention {name:34s} ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    what = [a for a in sys.argv[1:] if "=" not in a] or ["mla", "xla"]
    plans = {"split": SPLIT_K, "t": TRANSPOSED, "heads": ((128,), (16,))}
    for arg in sys.argv[1:]:
        name, _, given = arg.partition("=")
        if name in plans:
            plans[name] = tuple(tuple(int(x) for x in plan.split("/")) for plan in given.split(",") if plan)
    print(jax.devices(), flush=True)
    if "xla" in what:
        paged_xla()
    if "mla" in what:
        for (h,) in plans["heads"]:
            mla_case(h, plans["split"], plans["t"])
