"""An experiment for the chunked gla forward's costliest launch, ``chunk_intra_attn`` (1.36 ms of a 1.84 ms forward
at B4 T4096 H16 K=V=128 bf16 on the H200, 2026-12-04): the same scores ``A`` by sub-blocks of 16 rows.

``chunk_intra_attn`` runs one program per chunk and head (4096 programs of 8 warps at 248-255 registers a thread:
one program per SM) and takes the pairs ``i > j`` of a chunk of 64 in log2(64) = 6 levels, each a full 64 x 64
product masked to its pairs. Here a program takes one 16 x 16 block of ``A`` (grid ``(NT, HV, (C/16)^2)``, small
tiles, several programs per SM): a block below the diagonal is one product whose gates are referred to the first
row of its row block (both exponents <= 0, as at a level); a diagonal block takes its pairs in log2(16) = 4 levels
of 16-row products; blocks above the diagonal store zeros. If it is faster on the GPU, it replaces the level
kernel's use in ``ejkernel_triton.gla.chunk._prologue`` (and the same split suits ``chunk_dqk_intra``). ptxas for
sm_90 (Triton 3.9 here, bf16, K = 128, key tiles of 64): ``chunk_intra_attn`` 248 registers at 8 warps, 57344 bytes
of shared memory; this kernel 255 registers and 76 bytes spilled at 1 warp, 224 at 2, 128 at 4 (about 16.6 KB
shared): four programs of 4 warps fit an SM's registers where the level kernel fits one of 8.

The script records the forward's ``chunk_intra_attn`` launch, runs it and this kernel on the same arrays, compares
the two ``A`` (max abs difference over max abs), then times both (median of 20, ``jax.block_until_ready``) at
1, 2 and 4 warps. On the GPU machine: ``PYTHONPATH=/tmp/ejk-site python3 benchmarks/gpucheck/gla_intra_blocks.py``;
here in Triton's interpreter at tiny shapes: ``EJKERNEL_TRITON_INTERPRET=1 .venv/bin/python
benchmarks/gpucheck/gla_intra_blocks.py --small``.
"""

# ruff: noqa: I001  (ejkernel_triton.launch first: it sets the interpreter switch before triton is imported)
from __future__ import annotations

import statistics
import sys
import time

from ejkernel_triton import launch  # first: it sets Triton's interpreter switch before triton is imported

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from ejkernel_triton._chunk_kernels import chunk_span, gate, level, mm, tile
from ejkernel_triton.gla import chunk

SMALL = "--small" in sys.argv


@triton.jit
def intra_attn_blocks(
    Q,
    K_,
    GC,
    Cu,
    ChunkSeq,
    ChunkOff,
    scale,
    A,
    H: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    GK: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    LEVELS: tl.constexpr,
    PREC: tl.constexpr,
    DOT: tl.constexpr,
    EMU: tl.constexpr,
    BC: tl.constexpr,
    BC_LEVELS: tl.constexpr,
):
    """Block ``(i, j)`` (``BC`` rows each) of chunk ``i_t``'s scores ``A`` (scale included). Grid ``(NT, HV,
    (BT / BC)^2)``. ``LEVELS``: the level kernel's, unused (the diagonal blocks take ``BC_LEVELS = log2(BC)``)."""
    i_t, i_hv, i_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_i = i_p // (BT // BC)
    i_j = i_p % (BT // BC)
    i_h = i_hv // (HV // H)
    _, bos, n_rows = chunk_span(Cu, ChunkSeq, ChunkOff, i_t, BT)
    o_c = tl.arange(0, BC)
    r_i = i_i * BC + o_c  # the block's rows and columns within the chunk
    r_j = i_j * BC + o_c
    m_i = r_i < n_rows
    m_j = r_j < n_rows
    b_a = tl.zeros([BC, BC], dtype=tl.float32)
    if i_i > i_j:
        ref = i_i * BC  # every row of block i is at or past it, every column of block j before it
        for i_k in range(tl.cdiv(DK, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < DK
            m_ik = m_i[:, None] & m_k[None, :]
            m_kj = m_k[:, None] & m_j[None, :]
            b_q = tile(Q, bos + r_i[:, None], o_k[None, :], m_ik, i_h, H, DK)
            b_g = gate(GC, bos + r_i[:, None], o_k[None, :], m_ik, i_hv, HV, GK)
            b_kT = tile(K_, bos + r_j[None, :], o_k[:, None], m_kj, i_h, H, DK)
            b_gT = gate(GC, bos + r_j[None, :], o_k[:, None], m_kj, i_hv, HV, GK)
            b_r = gate(GC, bos + ref, o_k, m_k & (ref + o_k * 0 < n_rows), i_hv, HV, GK)  # [BK]
            b_qs = b_q * tl.exp(tl.where(m_ik, b_g - b_r[None, :], float("-inf")))
            b_ks = b_kT * tl.exp(tl.where(m_kj, b_r[:, None] - b_gT, float("-inf")))
            b_a = mm(b_qs, b_ks, b_a, 1, 1, DOT, EMU, PREC)
    elif i_i == i_j:
        n_local = n_rows - i_i * BC
        b_d = tl.zeros([BC], dtype=tl.float32)
        for i_k in range(tl.cdiv(DK, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < DK
            m_ik = m_i[:, None] & m_k[None, :]
            m_ki = m_k[:, None] & m_i[None, :]
            b_q = tile(Q, bos + r_i[:, None], o_k[None, :], m_ik, i_h, H, DK)
            b_g = gate(GC, bos + r_i[:, None], o_k[None, :], m_ik, i_hv, HV, GK)
            b_kT = tile(K_, bos + r_i[None, :], o_k[:, None], m_ki, i_h, H, DK)
            b_gT = gate(GC, bos + r_i[None, :], o_k[:, None], m_ki, i_hv, HV, GK)
            b_d += tl.sum(b_q * tile(K_, bos + r_i[:, None], o_k[None, :], m_ik, i_h, H, DK), axis=1)
            for lv in range(BC_LEVELS):
                S = BC >> (lv + 1)
                ref_l, up, lo = level(o_c, n_local, S)
                m_uk = up[:, None] & m_k[None, :]
                m_kl = m_k[:, None] & lo[None, :]
                b_r = gate(GC, bos + i_i * BC + ref_l[:, None], o_k[None, :], m_uk, i_hv, HV, GK)
                b_rT = gate(GC, bos + i_i * BC + ref_l[None, :], o_k[:, None], m_kl, i_hv, HV, GK)
                b_qs = b_q * tl.exp(tl.where(m_uk, b_g - b_r, float("-inf")))
                b_ks = b_kT * tl.exp(tl.where(m_kl, b_rT - b_gT, float("-inf")))
                b_p = mm(b_qs, b_ks, tl.zeros([BC, BC], dtype=tl.float32), 1, 1, DOT, EMU, PREC)
                b_a += tl.where((o_c[:, None] // (2 * S)) == (o_c[None, :] // (2 * S)), b_p, 0.0)
        b_a += tl.where(o_c[:, None] == o_c[None, :], b_d[:, None], 0.0)
    p_a = A + ((i_t.to(tl.int64) * HV + i_hv) * BT + r_i[:, None]) * BT + r_j[None, :]
    tl.store(p_a, (b_a * scale).to(A.dtype.element_ty))


def bench(fn, *args, n=20, warmup=3):
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def recorded_intra_attn(b, t, h, dk, dv, dtype, cu=None):
    """The forward's ``chunk_intra_attn`` launch: ``(args, kwargs)`` as ``launch.launch`` got them."""
    rng = np.random.default_rng(0)
    n = lambda *s: jnp.asarray(rng.standard_normal(s, dtype=np.float32))  # noqa: E731
    q, k, v = (n(b, t, h, d).astype(dtype) for d in (dk, dk, dv))
    g = jnp.asarray(-np.logaddexp(0.0, -rng.standard_normal((b, t, h, dk))).astype(np.float32) / 4)
    calls = []
    real = launch.launch

    def record(kernel, *a, **kw):
        if kw.get("name") == "ejkernel_gla_chunk_intra_attn":
            calls.append((kernel, a, kw))
        return real(kernel, *a, **kw)

    s = chunk.Static(
        chunk.make_plan(chunk.Dims(dk, dv), chunk.ChunkFwdParams(), "fwd"),
        chunk.make_plan(chunk.Dims(dk, dv), chunk.ChunkBwdParams(), "bwd"),
        dk**-0.5,
        False,
    )
    launch.launch = record
    try:
        rows = [chunk._rows(x) for x in (q, k, v, g)]
        if cu is not None:  # packed: the rows of one batch row, cut by cu_seqlens
            tab = chunk._chunk_table(1, b * t, s.fwd.chunk, jnp.asarray(cu, jnp.int32))
        else:
            tab = chunk._chunk_table(b, t, s.fwd.chunk, None)
        jax.block_until_ready(chunk._forward_rows(s, tab, *rows, None))
    finally:
        launch.launch = real
    (call,) = calls
    return call


def run(kernel0, a, kw, warps):
    """``chunk_intra_attn``'s launch (``warps`` None) or this kernel's at ``warps`` on the same arrays, jitted."""
    at = [i for i, x in enumerate(a) if isinstance(x, jax.Array)]
    if warps is None:
        kernel, kw2 = kernel0, kw
    else:
        bt = kw["BT"]
        bc = 16
        kernel = intra_attn_blocks
        kw2 = {**kw, "grid": (*kw["grid"], (bt // bc) ** 2), "num_warps": warps, "BC": bc,
               "BC_LEVELS": bc.bit_length() - 1, "name": "ejkernel_gla_intra_attn_blocks"}  # fmt: skip

    def one(*arrays):
        full = list(a)
        for i, x in zip(at, arrays, strict=True):
            full[i] = x
        return launch.launch(kernel, *full, **kw2)[0]

    return jax.jit(one), [a[i] for i in at]


def main():
    print("devices:", jax.devices())
    shapes = [("dense", (1, 100, 2, 32, 32), None), ("packed", (1, 100, 2, 32, 32), (0, 1, 37, 37, 90))]
    if not SMALL:
        shapes = [("dense B4 T4096 H16 K=V=128", (4, 4096, 16, 128, 128), None),
                  ("packed T4096", (1, 4096, 16, 128, 128), (0, 1, 1000, 1000, 3001, 4000))]  # fmt: skip
    for label, dims, cu in shapes:
        for dtype in (jnp.bfloat16, jnp.float32):
            kernel0, a, kw = recorded_intra_attn(*dims, dtype, cu)
            f0, arrays = run(kernel0, a, kw, None)
            want = np.asarray(f0(*arrays), np.float32)
            scale = max(float(np.abs(want).max()), 1e-30)
            line = f"{label} {jnp.dtype(dtype).name} C{kw['BT']}: chunk_intra_attn {bench(f0, *arrays):7.3f} ms"
            for warps in (1, 2, 4):
                f, _ = run(kernel0, a, kw, warps)
                got = np.asarray(f(*arrays), np.float32)
                err = float(np.abs(got - want).max()) / scale
                tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
                line += f" | blocks w{warps} {bench(f, *arrays):7.3f} ms err {err:.1e} {'ok' if err <= tol else 'FAIL'}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
