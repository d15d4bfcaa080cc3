"""ejkernel-triton's split-K decode (``page_attention``, ``ragged_decode_attention``) in Triton's interpreter.

The conformance suites check the contracts; this file checks what is particular to the split-K kernel: launch
parameters (the clear errors, the generic mapping), the split count on an H200 at batch 1 and 256, the merge with
more splits than blocks (empty splits), steps of several pages, wide GQA packing, and table entries out of range
under ``jit`` (clamped, never read outside the cache).
"""

from __future__ import annotations

import importlib.util
import os

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed: the Triton interpreter tests need it", allow_module_level=True)

os.environ["EJKERNEL_TRITON_INTERPRET"] = "1"  # before anything imports triton

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ejkernel.kernels.params import FwdParams  # noqa: E402
from ejkernel.testing import reference  # noqa: E402

from ejkernel_triton._decode import DenseDecodeParams, PagedDecodeParams, num_splits  # noqa: E402
from ejkernel_triton.page_attention import page_attention  # noqa: E402
from ejkernel_triton.ragged_decode_attention import ragged_decode_attention  # noqa: E402
from ejkernel_triton.ragged_page_attention import RaggedPageParams, ragged_page_attention  # noqa: E402


def _paged(rng, lens, page, h, kh, d, dtype=np.float32):
    m = max(1, -(-max(lens) // page))
    pages = rng.permutation(len(lens) * m + 3)
    tables = pages[: len(lens) * m].reshape(len(lens), m).astype(np.int32)
    kc = rng.standard_normal((len(pages), page, kh, d)).astype(dtype)
    vc = rng.standard_normal((len(pages), page, kh, d)).astype(dtype)
    q = rng.standard_normal((len(lens), h, d)).astype(dtype)
    return q, kc, vc, np.asarray(lens, np.int32), tables


def test_params_errors_name_the_field():
    with pytest.raises(ValueError, match="PagedDecodeParams.pages_per_block"):
        PagedDecodeParams(pages_per_block=0)
    with pytest.raises(ValueError, match="PagedDecodeParams.num_warps must be a power of two"):
        PagedDecodeParams(num_warps=3)
    with pytest.raises(ValueError, match="DenseDecodeParams.keys_per_block"):
        DenseDecodeParams(keys_per_block=8)
    with pytest.raises(ValueError, match="PagedDecodeParams.num_splits"):
        PagedDecodeParams(num_splits=-1)
    assert PagedDecodeParams(num_splits=0).num_splits == 0  # 0 = auto
    assert DenseDecodeParams.from_generic(FwdParams(kv_blocksize=32, num_warps=8)) == DenseDecodeParams(
        keys_per_block=32, num_warps=8
    )
    with pytest.raises(ValueError, match="q_blocksize"):
        PagedDecodeParams.from_generic(FwdParams(q_blocksize=16))


def test_split_count_fills_an_h200():
    """132 SMs: batch 1 x 32k context splits the context; batch 256 x 1k needs no split."""
    assert num_splits(1, 8, 32768, 64, sms=132) * 8 >= 4 * 132
    assert num_splits(256, 8, 1024, 64, sms=132) == 1
    assert num_splits(64, 8, 4096, 64, sms=132) * 64 * 8 >= 4 * 132
    assert num_splits(1, 8, 64, 64, sms=132) == 1  # one block: nothing to split


@pytest.mark.parametrize(
    ("page", "pages_per_block", "splits", "h", "kh", "d"),
    [(8, 4, 7, 16, 2, 64), (16, 1, 1, 8, 1, 128), (4, 8, 3, 4, 4, 32)],
)
def test_page_attention_launches_match_reference(page, pages_per_block, splits, h, kh, d):
    rng = np.random.default_rng(page * 31 + splits)
    args = _paged(rng, [0, 1, 45, 70, 9], page, h, kh, d)
    p = PagedDecodeParams(num_splits=splits, pages_per_block=pages_per_block)
    for kw in ({}, {"sliding_window": 20, "logits_soft_cap": 3.0}):
        out = jax.jit(lambda *a, kw=kw: page_attention(*a, fwd_params=p, **kw))(*args)
        want = reference.page_attention(*args, **kw)
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5, rtol=2e-5)
        assert np.all(np.asarray(out)[0] == 0)


def test_out_of_range_table_entries_are_clamped_under_jit():
    rng = np.random.default_rng(0)
    q, kc, vc, lens, tables = _paged(rng, [30, 17], 8, 4, 2, 32)
    bad = tables.copy()
    bad[0, 1], bad[1, 0] = 10_000, -5
    lens_past = np.asarray([30, 10_000], np.int32)  # past M * page: clamped to the table's capacity
    out = jax.jit(page_attention)(q, kc, vc, lens_past, bad)
    fixed = np.clip(bad, 0, kc.shape[0] - 1)
    want = reference.page_attention(q, kc, vc, np.minimum(lens_past, tables.shape[1] * 8), fixed)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_ragged_decode_more_splits_than_blocks_bf16():
    rng = np.random.default_rng(1)
    b, s, h, kh, d = 3, 50, 8, 1, 64
    q = jnp.asarray(rng.standard_normal((b, h, d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((b, s, kh, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((b, s, kh, d)), jnp.bfloat16)
    start, end = jnp.asarray([0, 7, 40], jnp.int32), jnp.asarray([50, 9, 45], jnp.int32)
    out = ragged_decode_attention(q, k, v, start, end, fwd_params=DenseDecodeParams(num_splits=9, keys_per_block=16))
    want = reference.ragged_decode_attention(q, k, v, start, end)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize(
    ("h", "kh", "d", "dv", "page", "block_m", "options"),
    [
        (6, 2, 48, 24, 4, 16, {"logits_soft_cap": 3.0}),  # G = 3 (5 rows a tile), head dims below the block
        (4, 1, 32, 32, 16, 32, {"sliding_window": 20}),  # MQA, blocks before the window skipped
    ],
)
def test_ragged_page_prefill_tiles_long_contexts(h, kh, d, dv, page, block_m, options):
    """What the conformance suite's short contexts miss: key blocks every row of a tile admits whole (the unmasked
    loop), several tiles of one sequence, tile rows that are not a power of two, a page wider than a key block."""
    rng = np.random.default_rng(h + page)
    seqs = [(3, 70), (1, 50), (40, 90), (2, 2), (17, 17), (1, 1)]
    q_lens = [q for q, _ in seqs]
    lens = [kv for _, kv in seqs] + [0]
    q, kc, vc, kv, tables = _paged(rng, lens, page, h, kh, d)
    vc = rng.standard_normal((*vc.shape[:-1], dv)).astype(np.float32)
    t = sum(q_lens) + 3  # 3 padding rows
    q = rng.standard_normal((t, h, d)).astype(np.float32)
    cu = np.asarray([0, *np.cumsum(q_lens), t + 4], np.int32)  # a garbage offset past num_seqs
    args = tuple(jnp.asarray(x) for x in (q, kc, vc, kv, tables, cu, [len(seqs)]))
    p = RaggedPageParams(num_splits=3, prefill_block_m=block_m, prefill_block_n=16)
    out = jax.jit(lambda *a: ragged_page_attention(*a, fwd_params=p, **options))(*args)
    want = reference.ragged_page_attention(*args, **options)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5, rtol=2e-5)
    assert np.all(np.asarray(out)[sum(q_lens) :] == 0)


def test_ragged_page_params():
    with pytest.raises(ValueError, match="RaggedPageParams.prefill_block_m must be a power of two >= 16"):
        RaggedPageParams(prefill_block_m=8)
    with pytest.raises(ValueError, match="RaggedPageParams.prefill_num_warps must be a power of two"):
        RaggedPageParams(prefill_num_warps=6)
    assert isinstance(RaggedPageParams(), PagedDecodeParams)  # what the registry's class check accepts
    assert RaggedPageParams.from_generic(FwdParams(num_warps=8)) == RaggedPageParams(num_warps=8)


def test_device_copy_the_bench_ceiling_is_exact():
    """The ``triton-copy`` peer of ``ejkernel bench`` (the bandwidth ceiling of the decode kernels): an exact copy,
    lengths not a multiple of the block included."""
    from ejkernel.bench.peers import PEERS

    from ejkernel_triton.copy import device_copy

    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 1000, 7)), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(device_copy(x, block=1024), np.float32), np.asarray(x, np.float32))
    even = x.reshape(-1)[:2048]  # a multiple of the block: the unmasked path
    np.testing.assert_array_equal(np.asarray(device_copy(even, block=1024)), np.asarray(even))
    half = device_copy(x, size=x.size // 2, block=1024)  # the MLA peer's half of the cache
    np.testing.assert_array_equal(np.asarray(half, np.float32), np.asarray(x.reshape(-1)[: x.size // 2], np.float32))
    with pytest.raises(ValueError, match="size must be"):
        device_copy(x, size=0)
    for op in ("page_attention", "ragged_decode_attention", "multi_head_latent_attention"):
        peer = PEERS[(op, "triton-copy")]
        assert peer.gpu_only and peer.reference is not None
