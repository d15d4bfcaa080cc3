"""ejkernel-pallas Mosaic TPU ragged decode attention, checked on CPU.

The conformance suite (``tests/conformance``, with ``EJKERNEL_PALLAS_INTERPRET=1``) compares the
kernel in JAX's TPU interpret mode with the reference. This module adds what the suite does not reach:
long caches over many key blocks, ranges that start and end inside blocks far from both ends (blocks
outside a range, or before its window, skipped with clamped index maps), the per-row schedule itself,
the interpreter's race detection, and lowering to Mosaic for a TPU (the step before libtpu compiles it).
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
from ejkernel.testing.conformance._paged import normal, numpy_rng  # noqa: E402
from ejkernel.testing.reference import ragged_decode_attention as reference  # noqa: E402

from ejkernel_pallas.tpu._paged import FIELDS, NF  # noqa: E402
from ejkernel_pallas.tpu.params import DecodeKeyParams  # noqa: E402
from ejkernel_pallas.tpu.ragged_decode_attention import (  # noqa: E402
    ragged_decode_attention,
    ragged_decode_attention_interpret,
)
from ejkernel_pallas.tpu.ragged_decode_attention._kernels import range_items  # noqa: E402


def _inputs(key, ranges, s, h, k, d, dtype):  # noqa: ANN001, ANN202
    """Inputs with NaN in every key and value outside its row's range, and the same inputs with zeros there."""
    rng = numpy_rng(key)
    b = len(ranges)
    q = normal(rng, (b, h, d), dtype)
    kv = [np.asarray(normal(rng, (b, s, k, d), dtype), np.float32) for _ in range(2)]
    start, end = (np.array([r[i] for r in ranges]) for i in (0, 1))
    j = np.arange(s)[None, :, None, None]
    outside = (j < start[:, None, None, None]) | (j >= end[:, None, None, None])
    poisoned = [jnp.asarray(np.where(outside, np.nan, x), dtype) for x in kv]
    clean = [jnp.asarray(np.where(outside, 0.0, x), dtype) for x in kv]
    bounds = (jnp.asarray(start, jnp.int32), jnp.asarray(end, jnp.int32))
    return (q, *poisoned, *bounds), (q, *clean, *bounds)


@pytest.mark.parametrize(
    ("ranges", "h", "k", "dtype", "params", "options"),
    [
        # 64-key blocks over S = 300 (the last one partial); a window of 50 skips most blocks of the long ranges.
        (((0, 300), (70, 75), (130, 290), (200, 200), (-9, 129)), 8, 2, "float32", 64, {"sliding_window": 50}),
        # MQA in bfloat16, 40 keys per block (8 blocks, the last partial), soft cap and scale.
        (((10, 300), (299, 300), (41, 160)), 4, 1, "bfloat16", 40, {"logits_soft_cap": 5.0, "softmax_scale": 0.3}),
    ],
    ids=["gqa_window", "mqa_bf16_soft_cap"],
)
def test_many_blocks(ranges, h, k, dtype, params, options):
    key, seed = fresh_key()
    args, clean = _inputs(key, ranges, 300, h, k, 32, dtype)
    fn = jax.jit(
        lambda *a: ragged_decode_attention_interpret(*a, fwd_params=DecodeKeyParams(keys_per_block=params), **options)
    )
    out = fn(*args)
    assert out.dtype == args[0].dtype
    assert_close(out, reference(*clean, **options), FWD_RTOL[dtype], "forward", seed)
    empty = np.array([min(e, 300) <= max(s, 0) for s, e in ranges])
    assert np.all(np.asarray(out, np.float32)[empty] == 0), f"empty range (seed {seed})"


def test_schedule_covers_exactly_the_visible_blocks():
    start = jnp.array([0, 70, 200, -9, 130], jnp.int32)
    end = jnp.array([300, 75, 200, 129, 290], jnp.int32)
    sched = np.asarray(range_items(start, end, 300).schedule(bk=64, window=50, page=1, m=1)).reshape(-1, NF)
    got = {name: sched[:, i].tolist() for i, name in enumerate(FIELDS)}
    # row b sees [max(lo, hi - 50), hi): blocks of 64 keys
    assert got["first"] == [250 // 64, 70 // 64, 0, 79 // 64, 240 // 64]
    assert got["end"] == [5, 2, 0, 3, 5]
    assert got["lo"] == [0, 70, 200, 0, 130]
    assert got["pos"] == [299, 74, 199, 128, 289]
    assert got["rows"] == [1, 1, 0, 1, 1]


def test_no_races_detected(monkeypatch):
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as interpreter

    monkeypatch.setenv("EJKERNEL_PALLAS_DETECT_RACES", "1")
    key, seed = fresh_key()
    args, clean = _inputs(key, ((3, 40), (0, 0), (17, 21)), 40, 4, 2, 16, "float32")
    out = jax.jit(lambda *a: ragged_decode_attention_interpret(*a, fwd_params=DecodeKeyParams(keys_per_block=16)))(
        *args
    )
    assert_close(out, reference(*clean), 1e-5, "forward", seed)
    assert interpreter.races is not None, "race detection did not run"
    assert not interpreter.races.races_found, "the interpreter found a data race"


def test_lowers_to_mosaic_for_a_tpu(monkeypatch):
    """Lower (do not run) the kernel at a serving shape in bfloat16: 16 rows, a cache of 4096 positions,
    32 query heads over 8 kv heads of 128. Lowering is where Pallas checks block shapes against the TPU's
    tiling and emits Mosaic; only libtpu's compiler, absent here, comes after it. A TPU description stands
    in for the missing chip."""
    from jax._src.pallas.mosaic import tpu_info
    from jax.experimental.pallas import tpu as pltpu

    monkeypatch.setitem(tpu_info.registry, "cpu", lambda: pltpu.get_tpu_info_for_chip(pltpu.ChipVersion.TPU_V5P, 2))
    b, s, h, k, d = 16, 4096, 32, 8, 128
    q = jax.ShapeDtypeStruct((b, h, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, s, k, d), jnp.bfloat16)
    bounds = jax.ShapeDtypeStruct((b,), jnp.int32)

    def fn(*a):  # noqa: ANN002, ANN202
        return ragged_decode_attention(*a, sliding_window=1024, logits_soft_cap=30.0)

    text = jax.jit(fn).trace(q, kv, kv, bounds, bounds).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 1, "expected one Mosaic kernel"
