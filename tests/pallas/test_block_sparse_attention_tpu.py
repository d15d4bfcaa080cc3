"""ejkernel-pallas Mosaic TPU block-sparse attention, checked on CPU.

The conformance suite (``tests/conformance``, with ``EJKERNEL_PALLAS_INTERPRET=1``) compares the kernels in
JAX's TPU interpret mode with the reference on lengths that fit one tile. This module adds several tiles
per axis: tiles of several mask blocks (the default 64-token blocks in 128-token tiles; unequal 32/96
blocks in 128/384 tiles) and tiles equal to the mask blocks, so that the lists, the clamped index maps,
full and partial pairs and the in-kernel expansion of mask blocks run; different forward and backward
tiles; the schedule against the token-level truth; the interpreter's race detection; and lowering to
Mosaic for a TPU (the step before libtpu compiles it).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

if importlib.util.find_spec("ejkernel_pallas") is None:
    pytest.skip("ejkernel-pallas is not installed", allow_module_level=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from ejkernel.modules.operations.block_sparse_attention import block_sparse_mask  # noqa: E402
from ejkernel.ops import Invocation  # noqa: E402
from ejkernel.ops.utils.datacarrier import BwdParams, FwdParams  # noqa: E402
from ejkernel.testing.conformance._harness import assert_close, fresh_key  # noqa: E402
from ejkernel.testing.reference import block_sparse_attention as reference  # noqa: E402

from ejkernel_pallas.tpu.block_sparse_attention import (  # noqa: E402
    _schedule,
    block_sparse_attention,
    block_sparse_attention_interpret,
    supports,
)
from ejkernel_pallas.tpu.block_sparse_attention._kernels import Geometry, _expand  # noqa: E402
from ejkernel_pallas.tpu.block_sparse_attention.interface import tile  # noqa: E402


def _inputs(key, b, t, s, h, k, d, dv=None):  # noqa: ANN001, ANN202
    kq, kk, kv = jax.random.split(key, 3)
    return (
        jax.random.normal(kq, (b, t, h, d)),
        jax.random.normal(kk, (b, s, k, d)),
        jax.random.normal(kv, (b, s, k, dv or d)),
    )


def _check(args, kwargs, seed, **params):  # noqa: ANN001, ANN003, ANN202
    """Forward and gradients (one compiled program each side) against the reference; array options are traced."""
    arrays = {n: x for n, x in kwargs.items() if isinstance(x, jax.Array)}
    static = {n: x for n, x in kwargs.items() if n not in arrays}
    cot = jax.random.normal(jax.random.key(seed % 1000), args[0].shape[:3] + (args[2].shape[-1],))

    def both(fn):  # noqa: ANN001, ANN202
        def run(arr, *a):  # noqa: ANN001, ANN002, ANN202
            out, vjp = jax.vjp(lambda *x: fn(*x, **arr, **static), *a)
            return out, vjp(cot)

        return run

    out, grads = jax.jit(both(lambda *a, **kw: block_sparse_attention_interpret(*a, **kw, **params)))(arrays, *args)
    want, want_grads = both(reference)(arrays, *args)
    assert_close(out, want, 1e-5, "forward", seed)
    for name, g, w in zip(("dq", "dk", "dv"), grads, want_grads, strict=True):
        assert_close(g, w, 1e-5, name, seed)


def test_default_blocks_in_larger_tiles_with_patterns():
    """64-token mask blocks, 2 x 2 per forward tile and 4 x 2 per backward tile; T < S, causal, GQA."""
    key, seed = fresh_key()
    args = _inputs(key, 1, 520, 600, 2, 1, 16)
    kwargs = {"local_blocks": (1, 0), "global_blocks": 1, "causal": True}
    _check(args, kwargs, seed, bwd_params=BwdParams(q_blocksize=256, kv_blocksize=128))


def test_traced_per_head_mask_unequal_blocks_and_segments():
    """32 x 96 mask blocks in 128 x 384 tiles, a traced mask per head, segment ids, soft cap, Dv != D."""
    key, seed = fresh_key()
    b, t, s, h = 2, 300, 700, 2
    args = _inputs(key, b, t, s, h, 1, 16, dv=24)
    km, k1, k2 = jax.random.split(jax.random.fold_in(key, 1), 3)
    mask = jax.random.bernoulli(km, 0.5, (1, h, -(-t // 32), -(-s // 96)))
    kwargs = {
        "block_mask": mask,
        "q_block": 32,
        "kv_block": 96,
        "q_segment_ids": jnp.sort(jax.random.randint(k1, (b, t), 0, 3), axis=-1),
        "kv_segment_ids": jnp.sort(jax.random.randint(k2, (b, s), 0, 3), axis=-1),
        "logits_soft_cap": 2.0,
    }
    _check(args, kwargs, seed)


def test_no_races_detected_with_tiles_equal_to_the_mask_blocks(monkeypatch):
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as interpreter

    monkeypatch.setenv("EJKERNEL_PALLAS_DETECT_RACES", "1")
    key, seed = fresh_key()
    args = _inputs(key, 2, 256, 256, 2, 1, 16)
    mask = jnp.array([[[[True, False], [True, True]]], [[[False, True], [True, False]]]])  # per batch row
    _check(args, {"block_mask": mask, "q_block": 128, "kv_block": 128, "causal": True}, seed)
    assert interpreter.races is not None, "race detection did not run"
    assert not interpreter.races.races_found, "the interpreter found a data race"


def _token_truth(tl, mask, qseg, kseg):  # noqa: ANN001, ANN202
    """``[Lb, Lh, Tp, Sp]``: which token pairs the contract attends (padding: none)."""
    rows, cols = np.arange(tl.nqt * tl.bq)[:, None], np.arange(tl.nkt * tl.bk)[None, :]
    ok = (rows < tl.t) & (cols < tl.s)
    if tl.causal:
        ok &= cols <= rows + tl.offset
    blocks = np.repeat(np.repeat(mask, tl.q_block, axis=2), tl.kv_block, axis=3)
    blocks = np.pad(blocks, ((0, 0), (0, 0), (0, ok.shape[0] - blocks.shape[2]), (0, ok.shape[1] - blocks.shape[3])))
    ok = ok & blocks
    qs = np.pad(qseg, ((0, 0), (0, ok.shape[-2] - tl.t)), constant_values=-1)
    ks = np.pad(kseg, ((0, 0), (0, ok.shape[-1] - tl.s)), constant_values=-2)
    return ok & (qs[:, None, :, None] == ks[:, None, None, :])


def test_schedule_lists_every_attended_tile_and_marks_full_ones_exactly():
    """No attended token pair is skipped; a pair run without a token mask attends every real token pair;
    lists are sorted, counted and within the static grid lengths, which a pattern makes shorter than the axis."""
    rng = np.random.default_rng(0)
    tl = _schedule.Tiling(t=300, s=650, bq=128, bk=256, q_block=32, kv_block=64, causal=True)
    mask = rng.random((2, 3, 10, 11)) < 0.5
    qseg = np.sort(rng.integers(0, 3, (2, 300)), axis=-1)
    kseg = np.sort(rng.integers(0, 3, (2, 650)), axis=-1)
    mask[1], qseg[1], kseg[1] = True, 0, 0  # batch row 1: every block, one segment (full pairs below the diagonal)
    sched = _schedule.build(tl, jnp.asarray(mask), jnp.asarray(qseg), jnp.asarray(kseg))
    truth = _token_truth(tl, mask, qseg, kseg).reshape(2, 3, tl.nqt, tl.bq, tl.nkt, tl.bk)
    real_rows = (np.arange(tl.nqt * tl.bq) < tl.t).reshape(tl.nqt, tl.bq)[:, :, None, None]
    any_pair = truth.any(axis=(3, 5)).reshape(6, tl.nqt, tl.nkt)
    all_pair = (truth | ~real_rows).all(axis=(3, 5)).reshape(6, tl.nqt, tl.nkt)
    kv_steps, q_steps = _schedule.static_steps(tl, mask)
    entries = np.asarray(sched.kv_list).reshape(6, tl.nqt, tl.nkt)
    counts = np.asarray(sched.kv_count).reshape(6, tl.nqt)
    assert sched.lanes == (2, 3)
    assert counts.max() <= kv_steps
    n_full = 0
    for lane in range(6):
        for i in range(tl.nqt):
            listed = entries[lane, i, : counts[lane, i]]
            tiles, partial = listed >> 1, listed & 1
            assert list(tiles) == sorted(tiles), "lists are in increasing order"
            assert set(np.flatnonzero(any_pair[lane, i])) <= set(tiles), "an attended tile pair is not listed"
            for j, p in zip(tiles, partial, strict=True):
                assert p or all_pair[lane, i, j], "a pair with unattended token pairs runs without the token mask"
                n_full += int(not p)
    assert n_full > 0
    t_counts = np.asarray(sched.q_count).reshape(6, tl.nkt)
    assert t_counts.max() <= q_steps
    assert (t_counts.sum(axis=1) == counts.sum(axis=1)).all(), "the transposed lists hold the same pairs"

    local = _schedule.Tiling(t=2048, s=2048, bq=128, bk=128, q_block=64, kv_block=64, causal=True)
    pattern = block_sparse_mask(2048, 2048, local_blocks=(2, 0), causal=True)[None, None]
    assert _schedule.static_steps(local, pattern) == (2, 2), "a band of 2 tiles: grids of 2 steps, not 16"


@pytest.mark.parametrize(
    ("bq", "bk", "q_block", "kv_block"),
    [(128, 128, 64, 64), (100, 119, 5, 7), (128, 512, 8, 512), (16, 384, 16, 96)],
    ids=["default_2x2", "unequal_single_tile", "rows_first", "one_row"],
)
def test_mask_blocks_expand_to_the_token_mask(bq, bk, q_block, kv_block):
    """The in-kernel expansion (plain jnp here) of a tile's mask blocks, in both of its orders."""
    rq, rk = bq // q_block, bk // kv_block
    geo = Geometry(
        t=bq, s=bk, bq=bq, bk=bk, nqt=1, nkt=1, group=1, scale=1.0, causal=False, soft_cap=None,
        has_segments=False, lanes=(1, 1), mask_lanes=(1, 1), q_block=q_block, kv_block=kv_block,
        kv_steps=1, q_steps=1,
    )  # fmt: skip
    sub = np.random.default_rng(rq * rk).random((rq, rk)) < 0.5
    want = np.repeat(np.repeat(sub, q_block, axis=0), kv_block, axis=1)
    np.testing.assert_array_equal(np.asarray(_expand(geo, jnp.asarray(sub, jnp.int32))), want)


def test_tiles_and_what_is_declined():
    assert tile(1000, 64, 16, 128) == 128  # 2 default blocks
    assert tile(1000, 5, 16, 128) == 80  # multiples of lcm(5, 16)
    assert tile(99, 5, 16, 256) == 100  # one tile: the whole axis (rounded up to the blocks), any size
    assert tile(70, 5, 16, 128) == 70
    assert tile(5000, 100, 128, 128) is None  # lcm(100, 128) = 3200 > MAX_TILE
    assert tile(2000, 100, 128, 128) == 2000  # ... unless one tile covers the axis
    assert tile(99, 5, 16, 100) == 100  # idempotent

    def inv(dtype, s, kv_block):  # noqa: ANN001, ANN202
        arguments = {
            "query": jax.ShapeDtypeStruct((1, 256, 2, 16), dtype),
            "key": jax.ShapeDtypeStruct((1, s, 2, 16), dtype),
            "block_mask": jax.ShapeDtypeStruct((1, 1, 4, -(-s // kv_block)), jnp.bool_),
            "q_block": 64, "kv_block": kv_block, "local_blocks": None, "global_blocks": 0, "causal": False,
        }  # fmt: skip
        return Invocation.create("block_sparse_attention", arguments, "tpu")

    assert "float16" in (supports(inv(jnp.float16, 256, 64)) or "")
    assert supports(inv(jnp.bfloat16, 256, 64)) is None
    assert "kv_block=100" in (supports(inv(jnp.bfloat16, 5000, 100)) or "")


def test_lowers_to_mosaic_for_a_tpu(monkeypatch):
    """Lower (do not run) the TPU kernels, forward and backward, at a realistic shape in bfloat16.

    Lowering is where Pallas checks block shapes against the TPU's tiling and emits Mosaic; only
    libtpu's compiler, absent here, comes after it. A TPU description stands in for the missing chip.
    """
    from jax._src.pallas.mosaic import tpu_info
    from jax.experimental.pallas import tpu as pltpu

    monkeypatch.setitem(tpu_info.registry, "cpu", lambda: pltpu.get_tpu_info_for_chip(pltpu.ChipVersion.TPU_V5P, 2))
    b, t, h, k, d = 2, 2048, 8, 2, 128
    q = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, t, k, d), jnp.bfloat16)
    mask = jax.ShapeDtypeStruct((1, h, t // 64, t // 64), jnp.bool_)
    seg = jax.ShapeDtypeStruct((b, t), jnp.int32)

    def fwd(q, k, v, m, qs, ks):  # noqa: ANN001, ANN202
        kw = {"q_segment_ids": qs, "kv_segment_ids": ks, "causal": True, "logits_soft_cap": 3.0}
        return block_sparse_attention(q, k, v, block_mask=m, **kw, fwd_params=FwdParams(256, 256))

    def grads(*a):  # noqa: ANN002, ANN202
        return jax.grad(lambda *x: fwd(*x).astype(jnp.float32).sum(), argnums=(0, 1, 2))(*a)

    for fn, kernels in ((fwd, 1), (grads, 3)):
        text = jax.jit(fn).trace(q, kv, kv, mask, seg, seg).lower(lowering_platforms=("tpu",)).as_text()
        assert text.count("tpu_custom_call") == kernels, f"{fn.__name__}: expected {kernels} Mosaic kernels"
