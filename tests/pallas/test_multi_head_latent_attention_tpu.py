"""ejkernel-pallas Mosaic TPU multi-head latent attention (decode), checked on CPU.

The conformance suite (``tests/conformance``, with ``EJKERNEL_PALLAS_INTERPRET=1``) compares the kernels
in JAX's TPU interpret mode with the reference; its shapes fit one key block and one query tile. This
module adds several query tiles and key blocks (block skipping past each sequence's length and each
tile's causal end, the clamped index maps), paged key blocks of several pages with a shared page and
garbage (NaN) wherever no sequence may read, causal rows before the first key with ``T <= 16``, the
lane-aligned latent (value) slice, the interpreter's race detection, the decode limit of ``supports``,
and lowering to Mosaic for a TPU (the step before libtpu compiles it).
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("ejkernel_pallas") is None:
    pytest.skip("ejkernel-pallas is not installed", allow_module_level=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ejkernel.ops.utils.datacarrier import BwdParams, FwdParams  # noqa: E402
from ejkernel.testing.conformance._harness import FWD_RTOL, GRAD_RTOL, assert_close, fresh_key  # noqa: E402
from ejkernel.testing.reference import multi_head_latent_attention as reference  # noqa: E402

from ejkernel_pallas.tpu.multi_head_latent_attention import (  # noqa: E402
    multi_head_latent_attention,
    multi_head_latent_attention_interpret,
    supports,
)
from ejkernel_pallas.tpu.multi_head_latent_attention._kernels import FIELDS, NF, Geometry  # noqa: E402


def _paged(key, lens, page, t, h, d, dtype, shared=0):  # noqa: ANN001, ANN202
    """Queries and a paged cache whose every slot no sequence may read is NaN; table entries past the
    pages in use are garbage; sequence 1 starts with ``shared`` pages of sequence 0."""
    kq, kk, kp = jax.random.split(key, 3)
    maxp = -(-max(lens) // page) + 1
    num_pages = len(lens) * maxp + 2
    cache = np.array(jax.random.normal(kk, (num_pages, page, d), jnp.float32))
    tables = np.array(jax.random.permutation(kp, num_pages))[: len(lens) * maxp].reshape(len(lens), maxp)
    tables[1, :shared] = tables[0, :shared]
    readable = np.zeros((num_pages, page), bool)
    for b, n in enumerate(lens):
        used = -(-n // page)
        for p in range(used):
            readable[tables[b, p], : min(page, n - p * page)] = True
        tables[b, used:] = (-7, 10**6)[b % 2]
    cache[~readable] = np.nan
    q = jax.random.normal(kq, (len(lens), t, h, d), jnp.float32).astype(dtype)
    kwargs = {"block_tables": jnp.asarray(tables, jnp.int32), "cache_seqlens": jnp.asarray(lens, jnp.int32)}
    return q, jnp.asarray(cache, dtype), kwargs


def _value_and_grads(fn, q, kv, seed, **kwargs):  # noqa: ANN001, ANN003, ANN202
    """``(out, (dq, dkv))`` of ``sum(out * cot)`` in one compiled call."""
    arrays = {k: v for k, v in kwargs.items() if isinstance(v, jax.Array)}
    static = {k: v for k, v in kwargs.items() if k not in arrays}

    def run(q, kv, arrays):  # noqa: ANN001, ANN202
        out, vjp = jax.vjp(lambda q, kv: fn(q, kv, **arrays, **static), q, kv)
        cot = jax.random.normal(jax.random.key(seed % 1000), out.shape, jnp.float32).astype(out.dtype)
        return out, vjp(cot)

    return jax.jit(run)(q, kv, arrays)


def _check(q, kv, kwargs, params, dtype, seed):  # noqa: ANN001, ANN202
    def kernel(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        return multi_head_latent_attention_interpret(*a, **kw, **params)

    out, (dq, dkv) = _value_and_grads(kernel, q, kv, seed, **kwargs)
    want, (want_dq, want_dkv) = _value_and_grads(reference, q, jnp.nan_to_num(kv), seed, **kwargs)
    assert out.dtype == q.dtype and dq.dtype == q.dtype and dkv.dtype == kv.dtype
    assert_close(out, want, FWD_RTOL[dtype], "forward", seed)
    assert_close(dq, want_dq, GRAD_RTOL[dtype], "dq", seed)
    assert_close(dkv, want_dkv, GRAD_RTOL[dtype], "dkv", seed)
    return out, dkv


@pytest.mark.parametrize(
    ("lens", "page", "t", "h", "dtype", "fwd", "bwd"),
    [
        # 24 rows (2 forward tiles of 16), 2 pages per forward block (up to 13 blocks), 16 per backward block
        # (128 keys: 2 blocks); an empty sequence; the first two pages shared.
        ((0, 37, 200), 8, 3, 8, "float32", FwdParams(q_blocksize=16, kv_blocksize=16), BwdParams()),
        # bfloat16 speculative decode (T=4): query 0 of the 3-key sequence sees no key; 3 pages of 16 per block.
        ((3, 150), 16, 4, 4, "bfloat16", FwdParams(kv_blocksize=48), BwdParams(kv_blocksize=128)),
    ],
    ids=["f32_tiles_2_pages_per_block", "bf16_speculative_3_pages_per_block"],
)
def test_paged_many_blocks_and_tiles_causal(lens, page, t, h, dtype, fwd, bwd):
    key, seed = fresh_key()
    q, kv, kwargs = _paged(key, lens, page, t, h, 24, dtype, shared=2)
    out, dkv = _check(
        q, kv, {**kwargs, "latent_dim": 16, "causal": True}, {"fwd_params": fwd, "bwd_params": bwd}, dtype, seed
    )
    assert np.all(np.asarray(out[list(lens).index(min(lens))], np.float32)[: max(0, t - min(lens))] == 0)
    assert np.all(np.isfinite(np.asarray(dkv, np.float32))), f"NaN leaked from unread cache slots (seed {seed})"


@pytest.mark.parametrize(
    ("t", "s", "dl", "dr", "options", "fwd"),
    [
        # 300 keys: 5 forward blocks of 64 (the last reaching past S), 3 backward blocks of 128.
        (5, 300, 32, 16, {"causal": True}, FwdParams(q_blocksize=16, kv_blocksize=64)),
        # T > S, causal: the first 5 query rows see no key; a lane-aligned latent (128 of 160 dims).
        (12, 7, 128, 32, {"causal": True, "softmax_scale": 0.2}, FwdParams()),
    ],
    ids=["causal_many_blocks", "t_gt_s_aligned_latent"],
)
def test_dense(t, s, dl, dr, options, fwd):
    key, seed = fresh_key()
    kq, kk = jax.random.split(key)
    q = jax.random.normal(kq, (2, t, 3, dl + dr))
    kv = jax.random.normal(kk, (2, s, dl + dr))
    out, _ = _check(q, kv, {"latent_dim": dl, **options}, {"fwd_params": fwd}, "float32", seed)
    if t > s:
        assert np.all(np.asarray(out[:, : t - s]) == 0), "causal rows before the first key must be zeros"


def test_schedule_of_causal_tiles():
    """Tile i's key end is its last real row's diagonal: rows r = 0..23 are queries r // 8 of T=3."""
    geo = Geometry(t=3, heads=8, bq=16, nr=2, bk=16, nk=7, pages=2, maxp=13, latent_dim=16, value_dim=24,
                   scale=1.0, causal=True)  # fmt: skip
    sched = np.asarray(geo.schedule(jnp.array([0, 1, 37, 100], jnp.int32))).reshape(4, 2, NF)
    got = {name: sched[..., i].tolist() for i, name in enumerate(FIELDS)}
    # tile 0 (rows 0..15, queries 0..1) ends at L - 1, tile 1 (queries 1..2) at L
    assert got["end"] == [[0, 0], [0, 1], [36, 37], [99, 100]]
    assert got["blocks"] == [[0, 0], [0, 1], [3, 3], [7, 7]]
    assert got["last_col"] == [[0, 0], [0, 0], [4, 4], [12, 12]]
    limits = geo.row_limits()[:, 0]
    assert limits[:8].tolist() == [-3] * 8 and limits[16:24].tolist() == [-1] * 8
    assert limits[24:].tolist() == [-(1 << 30)] * 8  # padding rows


def test_no_races_detected(monkeypatch):
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as interpreter

    monkeypatch.setenv("EJKERNEL_PALLAS_DETECT_RACES", "1")
    key, seed = fresh_key()
    q, kv, kwargs = _paged(key, (20, 9), 4, 2, 8, 16, "float32")
    params = {"fwd_params": FwdParams(kv_blocksize=8), "bwd_params": BwdParams(kv_blocksize=8)}
    _check(q, kv, {**kwargs, "latent_dim": 8, "causal": True}, params, "float32", seed)
    assert interpreter.races is not None, "race detection did not run"
    assert not interpreter.races.races_found, "the interpreter found a data race"


def test_supports_serves_decode_only():
    from ejkernel.modules.operations.multi_head_latent_attention import _kernel
    from ejkernel.ops import Invocation

    def reason(t: int, dtype: str) -> str | None:
        q, kv = jnp.zeros((1, t, 2, 576), dtype), jnp.zeros((1, 8, 576), dtype)
        return supports(Invocation.create(_kernel.op_id, _kernel.normalize(_kernel.bind((q, kv), {})), "tpu"))

    assert reason(16, "bfloat16") is None and reason(1, "float32") is None
    assert "prefill/training: use the XLA or a flash kernel" in (reason(17, "bfloat16") or "")
    assert "float16" in (reason(1, "float16") or "")


def test_lowers_to_mosaic_for_a_tpu(monkeypatch):
    """Lower (do not run) the kernels, forward and backward, at DeepSeek-V3 decode shapes in bfloat16: 8
    sequences of 2 queries (speculative decode) over 128 heads, a 576-dim latent (512 + 64 rotary), pages
    of 64 tokens, up to 64 pages each (8 pages per forward block); a dense cache of 1000 keys; and a
    160-dim latent of 192 (not lane-aligned) for 16 heads.
    Lowering is where Pallas checks block shapes against the TPU's tiling and emits Mosaic; only
    libtpu's compiler, absent here, comes after it. A TPU description stands in for the missing chip."""
    from jax._src.pallas.mosaic import tpu_info
    from jax.experimental.pallas import tpu as pltpu

    monkeypatch.setitem(tpu_info.registry, "cpu", lambda: pltpu.get_tpu_info_for_chip(pltpu.ChipVersion.TPU_V5P, 2))
    b, t, h, d, page, num_pages, maxp = 8, 2, 128, 576, 64, 1024, 64
    q = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((num_pages, page, d), jnp.bfloat16)
    dense = jax.ShapeDtypeStruct((b, 1000, d), jnp.bfloat16)
    tables, lens = jax.ShapeDtypeStruct((b, maxp), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32)

    def paged(q, kv, tables, lens):  # noqa: ANN001, ANN202
        return multi_head_latent_attention(q, kv, block_tables=tables, cache_seqlens=lens, causal=True)

    def dense_fn(q, kv):  # noqa: ANN001, ANN202
        return multi_head_latent_attention(q, kv, causal=True)

    # The values are then all 192 dims; the wrapper drops the rotary ones from the output.
    def unaligned_latent(q, kv):  # noqa: ANN001, ANN202
        return multi_head_latent_attention(q, kv, latent_dim=160)

    def grads(fn):  # noqa: ANN001, ANN202
        return lambda q, kv, *a: jax.grad(lambda q, kv: fn(q, kv, *a).astype(jnp.float32).sum(), (0, 1))(q, kv)

    q16, kv16 = jax.ShapeDtypeStruct((b, 1, 16, 192), jnp.bfloat16), jax.ShapeDtypeStruct((b, 1000, 192), jnp.bfloat16)
    cases = ((paged, (q, cache, tables, lens)), (dense_fn, (q, dense)), (unaligned_latent, (q16, kv16)))
    for fn, args in cases:
        for f, kernels in ((fn, 1), (grads(fn), 2)):
            text = jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
            assert text.count("tpu_custom_call") == kernels, f"{fn.__name__}: expected {kernels} Mosaic kernels"
