"""An experiment for the chunked gla's two costliest launches, ``chunk_intra_attn`` (1.36 ms of a 1.84 ms forward) and
``chunk_dqk_intra`` (2.06 ms of the backward) at B4 T4096 H16 K=V=128 bf16 on the H200 (2026-12-04, each launch
alone): the same results by blocks of 16 rows.

Both level kernels run one program of 8 warps per chunk, head (and key tile) at 248-255 registers a thread, i.e.
one program per SM, and take the pairs ``i > j`` of a chunk of 64 in log2(64) = 6 levels, each a full 64 x 64
product masked to that level's pairs. Here:

* ``intra_attn_blocks``: one program per 16 x 16 block of ``A`` (grid ``(NT, HV, (C/16)^2)``); a block below the
  diagonal is one product with its gates referred to the first row of its row block (both exponents <= 0, as at a
  level); a diagonal block takes its pairs in log2(16) = 4 levels of 16-row products; blocks above it store zeros.
* ``dqk_intra_blocks``: one program per 16 rows and key tile (grid ``(NT * C/16 * NK, HV)``): ``dq`` from the
  blocks before (referred to the block's first row), ``dk`` from the blocks after (each referred to its own first
  row), the block's own pairs in 4 levels.

If they are faster on the GPU they replace the level kernels in ``ejkernel_triton.gla.chunk`` (``_prologue`` and the
backward), after the GPU tier. ptxas for sm_90 (Triton 3.9 here, bf16, K = 128, key tiles of 64):
``chunk_intra_attn`` 248 registers at 8 warps, 57344 bytes of shared memory, ``chunk_dqk_intra`` 252 and 61440;
``intra_attn_blocks`` 255 registers and 76 bytes spilled at 1 warp, 224 at 2, 128 at 4, 165 at 8 (about 16.6 KB
shared); ``dqk_intra_blocks`` 230 at 2, 128 at 4, 112 at 8 (9-11 KB shared), none spilled: four programs of 4 warps
fit an SM's registers where a level kernel fits one of 8.

The script records both level launches of one forward + backward, runs each and its block kernel on the same
arrays, compares the results (max abs difference over max abs; rows that no packed sequence covers are written by
neither), then times both (the core timer) at 2, 4 and 8 warps, dense and packed, bf16 and
float32. On the GPU machine: ``PYTHONPATH=/tmp/ejk-site python3 benchmarks/gpucheck/gla_intra_blocks.py``; here in
Triton's interpreter at tiny shapes: ``EJKERNEL_TRITON_INTERPRET=1 .venv/bin/python
benchmarks/gpucheck/gla_intra_blocks.py --small``.
"""

# ruff: noqa: I001  (ejkernel_triton.launch first: it sets the interpreter switch before triton is imported)
from __future__ import annotations

import sys

from ejkernel_triton import launch  # first: it sets Triton's interpreter switch before triton is imported

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from ejkernel.ops.timing import time_fn
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


@triton.jit
def dqk_intra_blocks(
    Q,
    K_,
    GC,
    DA,
    Cu,
    ChunkSeq,
    ChunkOff,
    DQ,
    DK_,
    H: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    GK: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    LEVELS: tl.constexpr,
    PARTS: tl.constexpr,
    PREC: tl.constexpr,
    DOT: tl.constexpr,
    EMU: tl.constexpr,
    BC: tl.constexpr,
    BC_LEVELS: tl.constexpr,
):
    """``chunk_dqk_intra``'s intra-chunk shares of ``dq`` and ``dk`` (pairs ``i > j``), one program per block of
    ``BC`` rows and key tile: ``dq`` of the block from the blocks before it (gates referred to the block's first
    row), ``dk`` from the blocks after it (each referred to its own first row), the block's own pairs in
    ``BC_LEVELS`` levels. Grid ``(NT * (BT / BC) * cdiv(DK, BK), HV)``. ``LEVELS``, ``PARTS``: unused."""
    NK: tl.constexpr = (DK + BK - 1) // BK
    NC: tl.constexpr = BT // BC
    i_p, i_hv = tl.program_id(0), tl.program_id(1)
    i_t = i_p // (NC * NK)
    i_c = (i_p // NK) % NC
    i_k = i_p % NK
    i_h = i_hv // (HV // H)
    _, bos, n_rows = chunk_span(Cu, ChunkSeq, ChunkOff, i_t, BT)
    o_c = tl.arange(0, BC)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < DK
    r_c = i_c * BC + o_c
    m_c = r_c < n_rows
    m_ck = m_c[:, None] & m_k[None, :]
    p_da = DA + (i_t.to(tl.int64) * HV + i_hv) * BT * BT
    b_g = gate(GC, bos + r_c[:, None], o_k[None, :], m_ck, i_hv, HV, GK)
    b_q = tile(Q, bos + r_c[:, None], o_k[None, :], m_ck, i_h, H, DK)
    b_k = tile(K_, bos + r_c[:, None], o_k[None, :], m_ck, i_h, H, DK)

    # dq from the blocks before: u * sum_j dA_cj (k_j w_j), u = exp(b - b_ref), w = exp(b_ref - b_j)
    b_dq = tl.zeros([BC, BK], dtype=tl.float32)
    ref = i_c * BC
    b_ref = gate(GC, bos + ref, o_k, m_k & (ref + o_k * 0 < n_rows), i_hv, HV, GK)  # [BK]
    for i_j in range(i_c):
        r_j = i_j * BC + o_c
        m_jk = (r_j < n_rows)[:, None] & m_k[None, :]
        b_kw = tile(K_, bos + r_j[:, None], o_k[None, :], m_jk, i_h, H, DK) * tl.exp(
            tl.where(
                m_jk, b_ref[None, :] - gate(GC, bos + r_j[:, None], o_k[None, :], m_jk, i_hv, HV, GK), float("-inf")
            )
        )
        b_da = tl.load(p_da + r_c[:, None] * BT + r_j[None, :], mask=m_c[:, None] & (r_j < n_rows)[None, :], other=0.0)
        b_dq = mm(b_da, b_kw, b_dq, 1, 1, DOT, EMU, PREC)
    b_dq = b_dq * tl.exp(tl.where(m_ck, b_g - b_ref[None, :], float("-inf")))

    # dk from the blocks after: w_c * (dA_ic^T (q_i u_i)), each block i referred to its own first row
    b_dk = tl.zeros([BC, BK], dtype=tl.float32)
    for i_i in range(i_c + 1, NC):
        r_i = i_i * BC + o_c
        m_ik = (r_i < n_rows)[:, None] & m_k[None, :]
        b_ri = gate(GC, bos + i_i * BC, o_k, m_k & (i_i * BC + o_k * 0 < n_rows), i_hv, HV, GK)
        b_qu = tile(Q, bos + r_i[:, None], o_k[None, :], m_ik, i_h, H, DK) * tl.exp(
            tl.where(
                m_ik, gate(GC, bos + r_i[:, None], o_k[None, :], m_ik, i_hv, HV, GK) - b_ri[None, :], float("-inf")
            )
        )
        b_daT = tl.load(p_da + r_i[None, :] * BT + r_c[:, None], mask=m_c[:, None] & (r_i < n_rows)[None, :], other=0.0)
        b_p = mm(b_daT, b_qu, tl.zeros([BC, BK], dtype=tl.float32), 1, 1, DOT, EMU, PREC)
        b_dk += tl.exp(tl.where(m_ck, b_ri[None, :] - b_g, float("-inf"))) * b_p

    # the block's own pairs, level by level (as chunk_dqk_intra, on BC rows)
    n_local = n_rows - i_c * BC
    for lv in range(BC_LEVELS):
        S = BC >> (lv + 1)
        ref_l, up, lo = level(o_c, n_local, S)
        m_uk = up[:, None] & m_k[None, :]
        m_lk = lo[:, None] & m_k[None, :]
        b_r = gate(GC, bos + i_c * BC + ref_l[:, None], o_k[None, :], m_uk | m_lk, i_hv, HV, GK)
        b_e = tl.exp(tl.where(m_uk, b_g - b_r, tl.where(m_lk, b_r - b_g, float("-inf"))))
        b_u = tl.where(m_uk, b_e, 0.0)
        b_w = tl.where(m_lk, b_e, 0.0)
        m_s = (o_c[:, None] // (2 * S)) == (o_c[None, :] // (2 * S))
        b_da = tl.load(p_da + r_c[:, None] * BT + r_c[None, :], mask=m_s, other=0.0)
        b_daT = tl.load(p_da + r_c[None, :] * BT + r_c[:, None], mask=m_s, other=0.0)
        b_dq += b_u * mm(b_da, b_k * b_w, tl.zeros([BC, BK], dtype=tl.float32), 1, 1, DOT, EMU, PREC)
        b_dk += b_w * mm(b_daT, b_q * b_u, tl.zeros([BC, BK], dtype=tl.float32), 1, 1, DOT, EMU, PREC)

    p_x = ((bos + r_c)[:, None] * HV + i_hv) * DK + o_k[None, :]
    tl.store(DQ + p_x, b_dq, mask=m_ck)
    tl.store(DK_ + p_x, b_dk, mask=m_ck)


def bench(fn, *args):
    """Milliseconds per call by the core timer (``ejkernel.ops.timing``, what ``ejkernel bench`` uses)."""
    return time_fn(fn, *args) * 1e3


_BLOCKS = {  # the level kernel's launch name: this script's kernel, its grid from the launch's (chunks, BT, NK)
    "ejkernel_gla_chunk_intra_attn": (intra_attn_blocks, lambda nt, hv, nc, nk: (nt, hv, nc * nc)),
    "ejkernel_gla_chunk_dqk_intra": (dqk_intra_blocks, lambda nt, hv, nc, nk: (nt * nc * nk, hv)),
}


def recorded(b, t, h, dk, dv, dtype, cu=None):
    """The level kernels' launches of one forward + backward: ``{name: (kernel, args, kwargs, chunks)}``."""
    rng = np.random.default_rng(0)
    n = lambda *s: jnp.asarray(rng.standard_normal(s, dtype=np.float32))  # noqa: E731
    q, k, v = (n(b, t, h, d).astype(dtype) for d in (dk, dk, dv))
    g = jnp.asarray(-np.logaddexp(0.0, -rng.standard_normal((b, t, h, dk))).astype(np.float32) / 4)
    calls = {}
    real = launch.launch
    s = chunk.Static(
        chunk.make_plan(chunk.Dims(dk, dv), chunk.ChunkFwdParams(), "fwd"),
        chunk.make_plan(chunk.Dims(dk, dv), chunk.ChunkBwdParams(), "bwd"),
        dk**-0.5,
        False,
    )
    rows = [chunk._rows(x) for x in (q, k, v, g)]
    cu_ = None if cu is None else jnp.asarray(cu, jnp.int32)  # packed: the rows of one batch row
    tabs = [chunk._chunk_table(b, t, c, cu_) for c in (s.fwd.chunk, s.bwd.chunk)]

    def record(kernel, *a, **kw):
        if kw.get("name") in _BLOCKS:
            nt = (tabs[0] if "intra_attn" in kw["name"] else tabs[1]).nt
            calls[kw["name"]] = (kernel, a, kw, nt)
        return real(kernel, *a, **kw)

    launch.launch = record
    try:
        _, _, a, gc = jax.block_until_ready(chunk._forward_rows(s, tabs[0], *rows, None))
        do = jnp.asarray(rng.standard_normal(rows[2].shape, dtype=np.float32)).astype(dtype)
        jax.block_until_ready(chunk._backward_rows(s, tabs[1], *rows, None, do, None, a, gc))
    finally:
        launch.launch = real
    return calls


def run(call, warps):
    """The recorded level-kernel launch (``warps`` None) or this script's kernel at ``warps``, on the same arrays,
    jitted; and those arrays."""
    kernel, a, kw, nt = call
    at = [i for i, x in enumerate(a) if isinstance(x, jax.Array)]
    if warps is not None:
        bc = 16
        blocks, grid = _BLOCKS[kw["name"]]
        nk = -(-kw["DK"] // kw["BK"])
        kernel = blocks
        kw = {**kw, "grid": grid(nt, kw["grid"][1], kw["BT"] // bc, nk), "num_warps": warps, "BC": bc,
              "BC_LEVELS": bc.bit_length() - 1, "name": kw["name"] + "_blocks"}  # fmt: skip

    def one(*arrays):
        full = list(a)
        for i, x in zip(at, arrays, strict=True):
            full[i] = x
        return launch.launch(kernel, *full, **kw)

    return jax.jit(one), [a[i] for i in at]


def _rel_err(got, want):
    """Max abs difference over max abs; rows that no packed sequence covers are written by neither kernel (the
    launcher's caller drops them): skipped where both are not finite, an error where only one is."""
    both = ~np.isfinite(got) & ~np.isfinite(want)
    if (np.isfinite(got) != np.isfinite(want)).any():
        return float("inf")
    got, want = np.where(both, 0.0, got), np.where(both, 0.0, want)
    return float(np.abs(got - want).max()) / max(float(np.abs(want).max()), 1e-30)


def main():
    print("devices:", jax.devices())
    shapes = [("dense", (1, 100, 2, 32, 32), None), ("packed", (1, 100, 2, 32, 32), (0, 1, 37, 37, 90))]
    if not SMALL:
        shapes = [("dense B4 T4096 H16 K=V=128", (4, 4096, 16, 128, 128), None),
                  ("packed T4096", (1, 4096, 16, 128, 128), (0, 1, 1000, 1000, 3001, 4000))]  # fmt: skip
    for label, dims, cu in shapes:
        for dtype in (jnp.bfloat16, jnp.float32):
            for name, call in recorded(*dims, dtype, cu).items():
                f0, arrays = run(call, None)
                want = [np.asarray(x, np.float32) for x in f0(*arrays)]
                line = (
                    f"{label} {jnp.dtype(dtype).name} C{call[2]['BT']} {name[12:]}: levels {bench(f0, *arrays):7.3f} ms"
                )
                for warps in (2, 4, 8):
                    f, _ = run(call, warps)
                    try:
                        got = [np.asarray(x, np.float32) for x in f(*arrays)]
                    except Exception as e:  # noqa: BLE001
                        line += f" | blocks w{warps} ERROR {type(e).__name__}: {str(e)[:200]}"
                        continue
                    err = max(_rel_err(x, y) for x, y in zip(got, want, strict=True))
                    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
                    ok = "ok" if err <= tol else "FAIL"
                    line += f" | blocks w{warps} {bench(f, *arrays):7.3f} ms err {err:.1e} {ok}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
