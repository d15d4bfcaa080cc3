"""ejkernel-pallas Mosaic TPU page attention, checked on CPU.

The conformance suite (``tests/conformance``, with ``EJKERNEL_PALLAS_INTERPRET=1``) compares the
kernel in JAX's TPU interpret mode with the reference. This module adds what the suite does not reach:
long contexts over many key blocks of several pages (blocks before a window and past a length skipped,
the clamped page index maps), the per-sequence schedule itself, the interpreter's race detection, and
lowering to Mosaic for a TPU (the step before libtpu compiles it).
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
from ejkernel.testing.reference import page_attention as reference  # noqa: E402

from ejkernel_pallas.tpu._paged import FIELDS, NF  # noqa: E402
from ejkernel_pallas.tpu.page_attention import page_attention, page_attention_interpret  # noqa: E402
from ejkernel_pallas.tpu.page_attention._kernels import decode_items  # noqa: E402
from ejkernel_pallas.tpu.params import PagedKeyParams  # noqa: E402


def _inputs(key, lens, page, h, k, d, dtype):  # noqa: ANN001, ANN202
    rng = numpy_rng(key)
    cache = paged_cache(rng, dtype, list(lens), page=page, kv_heads=k, head_dim=d, value_dim=d)
    q = normal(rng, (len(lens), h, d), dtype)
    return q, *cache.poisoned(), jnp.asarray(lens, jnp.int32), cache.block_tables


@pytest.mark.parametrize(
    ("lens", "page", "h", "k", "dtype", "params", "options"),
    [
        # 2 pages (16 keys) per block, up to 9 blocks; a window of 20 skips the first blocks of the long ones.
        ((0, 5, 40, 97, 130), 8, 8, 2, "float32", PagedKeyParams(keys_per_block=16), {"sliding_window": 20}),
        # MQA in bfloat16, 3 pages (12 keys) per block, soft cap and scale; a block reaching past the table.
        ((61, 3, 33), 4, 4, 1, "bfloat16", PagedKeyParams(12), {"logits_soft_cap": 5.0, "softmax_scale": 0.3}),
    ],
    ids=["gqa_window_2_pages", "mqa_bf16_soft_cap_3_pages"],
)
def test_many_blocks_of_several_pages(lens, page, h, k, dtype, params, options):
    key, seed = fresh_key()
    q, kc, vc, lens_a, tables = _inputs(key, lens, page, h, k, 32, dtype)  # NaN wherever no sequence reads
    out = jax.jit(lambda *a: page_attention_interpret(*a, fwd_params=params, **options))(q, kc, vc, lens_a, tables)
    want = reference(q, jnp.nan_to_num(kc), jnp.nan_to_num(vc), lens_a, tables, **options)
    assert out.dtype == q.dtype
    assert_close(out, want, FWD_RTOL[dtype], "forward", seed)
    assert np.all(np.asarray(out, np.float32)[np.asarray(lens) == 0] == 0), f"empty sequence (seed {seed})"


def test_schedule_covers_exactly_the_visible_blocks():
    lens = jnp.array([0, 1, 16, 17, 100], jnp.int32)
    sched = np.asarray(decode_items(lens).schedule(bk=16, window=20, page=8, m=13)).reshape(-1, NF)
    got = {name: sched[:, i].tolist() for i, name in enumerate(FIELDS)}
    # the query of a sequence of L keys sits at L - 1 and sees [max(0, L - 20), L)
    assert got["first"] == [0, 0, 0, 0, 80 // 16]
    assert got["end"] == [0, 1, 1, 2, 7]
    assert got["rows"] == [0, 1, 1, 1, 1]
    assert got["last_page"] == [0, 0, 1, 2, 12]  # pages read: ceil(L / 8), the empty one clamped to 0


def test_no_races_detected(monkeypatch):
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as interpreter

    monkeypatch.setenv("EJKERNEL_PALLAS_DETECT_RACES", "1")
    key, seed = fresh_key()
    q, kc, vc, lens, tables = _inputs(key, (9, 0, 30), 4, 4, 2, 16, "float32")
    out = jax.jit(lambda *a: page_attention_interpret(*a, fwd_params=PagedKeyParams(keys_per_block=8)))(
        q, kc, vc, lens, tables
    )
    assert_close(out, reference(q, jnp.nan_to_num(kc), jnp.nan_to_num(vc), lens, tables), 1e-5, "forward", seed)
    assert interpreter.races is not None, "race detection did not run"
    assert not interpreter.races.races_found, "the interpreter found a data race"


def test_lowers_to_mosaic_for_a_tpu(monkeypatch):
    """Lower (do not run) the kernel at a serving shape in bfloat16: 16 sequences, 32 query heads over 8 kv
    heads of 128, pages of 16 tokens, up to 128 pages per sequence (16 pages per block: 16 page block specs
    per cache). Lowering is where Pallas checks block shapes against the TPU's tiling and emits Mosaic;
    only libtpu's compiler, absent here, comes after it. A TPU description stands in for the missing chip."""
    from jax._src.pallas.mosaic import tpu_info
    from jax.experimental.pallas import tpu as pltpu

    monkeypatch.setitem(tpu_info.registry, "cpu", lambda: pltpu.get_tpu_info_for_chip(pltpu.ChipVersion.TPU_V5P, 2))
    n, h, k, d, page, num_pages, m = 16, 32, 8, 128, 16, 2048, 128
    q = jax.ShapeDtypeStruct((n, h, d), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((num_pages, page, k, d), jnp.bfloat16)
    lens = jax.ShapeDtypeStruct((n,), jnp.int32)
    tables = jax.ShapeDtypeStruct((n, m), jnp.int32)

    def fn(*a):  # noqa: ANN002, ANN202
        return page_attention(*a, sliding_window=1024, logits_soft_cap=30.0)

    text = jax.jit(fn).trace(q, cache, cache, lens, tables).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 1, "expected one Mosaic kernel"
