"""ejkernel-pallas Mosaic TPU ragged paged attention, checked on CPU.

The conformance suite (``tests/conformance``, with ``EJKERNEL_PALLAS_INTERPRET=1``) compares the
kernel in JAX's TPU interpret mode with the reference. This module adds what the suite does not reach:
long prefills cut into several items of several rows (the first and last items partial), long contexts
over many key blocks of several pages (blocks past an item's last row or before its first row's window
skipped), the (sequence, query tile) schedule itself, the interpreter's race detection, and lowering to
Mosaic for a TPU (the step before libtpu compiles it).
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("ejkernel_pallas") is None:
    pytest.skip("ejkernel-pallas is not installed", allow_module_level=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ejkernel.testing.conformance._harness import FWD_RTOL, assert_close, fresh_key  # noqa: E402
from ejkernel.testing.conformance._paged import normal, numpy_rng, paged_cache  # noqa: E402
from ejkernel.testing.reference import ragged_page_attention as reference  # noqa: E402

from ejkernel_pallas.tpu._paged import FIELDS, NF  # noqa: E402
from ejkernel_pallas.tpu.params import RaggedItemParams  # noqa: E402
from ejkernel_pallas.tpu.ragged_page_attention import (  # noqa: E402
    ragged_page_attention,
    ragged_page_attention_interpret,
)
from ejkernel_pallas.tpu.ragged_page_attention._kernels import num_items, plan  # noqa: E402


def _inputs(key, seqs, page, h, k, d, dtype, pad_rows=2):  # noqa: ANN001, ANN202
    """Live sequences ``(q_len, kv_len)``, one padding slot (garbage length), ``pad_rows`` padding rows;
    the kernel gets caches with NaN wherever no sequence reads, the reference the same caches with zeros."""
    rng = numpy_rng(key)
    q_lens, kv_lens = [q for q, _ in seqs], [kv for _, kv in seqs]
    cache = paged_cache(rng, dtype, kv_lens + [0], page=page, kv_heads=k, head_dim=d, value_dim=d)
    t = sum(q_lens) + pad_rows
    cu = np.concatenate([[0], np.cumsum(q_lens), [1]]).tolist()
    rest = (
        jnp.asarray(kv_lens + [10_000], jnp.int32),
        cache.block_tables,
        jnp.asarray(cu, jnp.int32),
        jnp.array([len(seqs)], jnp.int32),
    )
    q = normal(rng, (t, h, d), dtype)
    poisoned = cache.poisoned()
    clean = tuple(jnp.nan_to_num(x) for x in poisoned)
    return (q, *poisoned, *rest), (q, *clean, *rest)


@pytest.mark.parametrize(
    ("seqs", "page", "h", "k", "dtype", "params", "options"),
    [
        # items of 16 rows: a 70-row prefill (5 items, the last partial), a chunked prefill of 20 rows over 200
        # keys, decodes; 2 pages (16 keys) per block, up to 13 blocks; a window of 30 skips the early blocks.
        (
            ((70, 70), (1, 95), (20, 200), (0, 9), (1, 1)), 8, 8, 2, "float32",
            RaggedItemParams(rows_per_item=16, keys_per_block=16), {"sliding_window": 30},
        ),
        # MQA in bfloat16, items of 5 rows, 3 pages (12 keys) per block, soft cap and scale.
        (
            ((1, 40), (13, 13), (9, 61)), 4, 4, 1, "bfloat16",
            RaggedItemParams(rows_per_item=5, keys_per_block=12), {"logits_soft_cap": 5.0, "softmax_scale": 0.3},
        ),
    ],
    ids=["gqa_window_16_rows_2_pages", "mqa_bf16_soft_cap_5_rows_3_pages"],
)  # fmt: skip
def test_many_items_and_blocks(seqs, page, h, k, dtype, params, options):
    key, seed = fresh_key()
    args, clean = _inputs(key, seqs, page, h, k, 32, dtype)
    out = jax.jit(lambda *a: ragged_page_attention_interpret(*a, fwd_params=params, **options))(*args)
    assert out.dtype == args[0].dtype
    assert_close(out, reference(*clean, **options), FWD_RTOL[dtype], "forward", seed)
    live_rows = sum(q for q, _ in seqs)
    assert np.all(np.asarray(out, np.float32)[live_rows:] == 0), f"padding rows must be zeros (seed {seed})"


def test_schedule_cuts_sequences_into_items():
    # live: (q 5, kv 12), (q 0, kv 4), (q 1, kv 9), (q 8, kv 8); slot 4 is padding (garbage offsets)
    cu = jnp.array([0, 5, 5, 6, 14, 2], jnp.int32)
    kv = jnp.array([12, 4, 9, 8, 999], jnp.int32)
    p = plan(cu, kv, jnp.array([4], jnp.int32), t=16, r=4)
    assert p.q_rows.shape == (num_items(16, 5, 4), 4)
    sched = np.asarray(p.items.schedule(bk=8, window=None, page=4, m=3)).reshape(-1, NF)
    got = {name: sched[:, i].tolist() for i, name in enumerate(FIELDS)}
    n = 5  # items: rows 0-3 and 4 of sequence 0, row 5 (sequence 2), rows 6-9 and 10-13 (sequence 3)
    assert got["seq"][:n] == [0, 0, 2, 3, 3]
    assert got["rows"] == [4, 1, 1, 4, 4] + [0] * (len(got["rows"]) - n)
    assert got["pos"][:n] == [7, 11, 8, 0, 4]  # kv_len - q_len + the item's first row
    assert got["hi"][:n] == [12, 12, 9, 8, 8]
    assert got["end"][:n] == [2, 2, 2, 1, 1]  # causal: an item reads up to its last row's position
    assert np.asarray(p.q_rows)[:n, 0].tolist() == [0, 4, 5, 6, 10]


def test_no_races_detected(monkeypatch):
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as interpreter

    monkeypatch.setenv("EJKERNEL_PALLAS_DETECT_RACES", "1")
    key, seed = fresh_key()
    args, clean = _inputs(key, ((6, 14), (1, 5)), 4, 4, 2, 16, "float32")
    out = jax.jit(
        lambda *a: ragged_page_attention_interpret(*a, fwd_params=RaggedItemParams(rows_per_item=4, keys_per_block=8))
    )(*args)
    assert_close(out, reference(*clean), 1e-5, "forward", seed)
    assert interpreter.races is not None, "race detection did not run"
    assert not interpreter.races.races_found, "the interpreter found a data race"


def test_lowers_to_mosaic_for_a_tpu(monkeypatch):
    """Lower (do not run) the kernel at a serving shape in bfloat16: 1024 query rows over 64 sequence slots
    (items of 16 rows), 32 query heads over 8 kv heads of 128, pages of 16 tokens, up to 128 pages per
    sequence. Lowering is where Pallas checks block shapes against the TPU's tiling and emits Mosaic; only
    libtpu's compiler, absent here, comes after it. A TPU description stands in for the missing chip."""
    from jax._src.pallas.mosaic import tpu_info
    from jax.experimental.pallas import tpu as pltpu

    monkeypatch.setitem(tpu_info.registry, "cpu", lambda: pltpu.get_tpu_info_for_chip(pltpu.ChipVersion.TPU_V5P, 2))
    t, s, h, k, d, page, num_pages, m = 1024, 64, 32, 8, 128, 16, 4096, 128
    q = jax.ShapeDtypeStruct((t, h, d), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((num_pages, page, k, d), jnp.bfloat16)
    lens = jax.ShapeDtypeStruct((s,), jnp.int32)
    tables = jax.ShapeDtypeStruct((s, m), jnp.int32)
    cu = jax.ShapeDtypeStruct((s + 1,), jnp.int32)
    n = jax.ShapeDtypeStruct((1,), jnp.int32)

    def fn(*a):  # noqa: ANN002, ANN202
        return ragged_page_attention(*a, sliding_window=1024, logits_soft_cap=30.0)

    text = jax.jit(fn).trace(q, cache, cache, lens, tables, cu, n).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 1, "expected one Mosaic kernel"
