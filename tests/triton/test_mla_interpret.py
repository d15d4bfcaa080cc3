"""ejkernel-triton's ``multi_head_latent_attention`` decode kernel in Triton's interpreter.

The conformance suite checks the contract; this file checks what is particular to the split-K kernel: launch
parameters (the clear errors, the generic mapping), the split count at DeepSeek-V3's dims on an H200 at batch 1 and
64, the plans offered on a GPU (both ways to hold the accumulator, and the transposed form for few rows), what
``supports`` declines, and table entries out of range under ``jit`` (clamped, never read outside the cache) in both
forms of the kernel.
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

from ejkernel_triton.multi_head_latent_attention import interface  # noqa: E402

MlaDecodeParams, multi_head_latent_attention, supports = (
    interface.MlaDecodeParams,
    interface.multi_head_latent_attention,
    interface.supports,
)

DEEPSEEK = {"h": 128, "dl": 512, "dr": 64}


def _deepseek(b: int, keys: int = 4096, e: int = 2, heads: int = DEEPSEEK["h"]) -> interface.Dims:
    return interface.Dims(b, 1, heads, DEEPSEEK["dl"], DEEPSEEK["dr"], keys, e)


def test_params_errors_name_the_field():
    with pytest.raises(ValueError, match="MlaDecodeParams.block_rows must be a power of two from 16 to 128"):
        MlaDecodeParams(block_rows=8)
    with pytest.raises(ValueError, match="MlaDecodeParams.block_dv"):
        MlaDecodeParams(block_dv=48)
    with pytest.raises(ValueError, match="MlaDecodeParams.num_splits"):
        MlaDecodeParams(num_splits=-1)
    assert MlaDecodeParams(num_splits=0).num_splits == 0  # 0 = auto
    assert MlaDecodeParams.from_generic(FwdParams(kv_blocksize=32, num_warps=8)) == MlaDecodeParams(
        block_n=32, num_warps=8
    )
    with pytest.raises(ValueError, match="q_blocksize"):
        MlaDecodeParams.from_generic(FwdParams(q_blocksize=16))
    with pytest.raises(ValueError, match="MlaDecodeParams.transposed must be a bool or None, got 1"):
        MlaDecodeParams(transposed=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_dv must be None or at least 512, got 256"):
        interface.make_plan(_deepseek(1, heads=16), MlaDecodeParams(transposed=True, block_dv=256))
    assert interface.make_plan(_deepseek(1), MlaDecodeParams(transposed=True)).block_dv == 512


def test_split_count_fills_an_h200():
    # batch 1: 2 row blocks x 2 value blocks would leave 128 of 132 SMs idle; batch 64: 256 programs already
    for b, want in ((1, 64), (64, 2), (256, 1)):
        d = _deepseek(b)
        splits = interface.num_splits(d, 64, 256, 32, sms=132)
        assert splits == want
        assert b * 2 * 2 * splits >= 132 or splits == interface._MAX_SPLITS
    # a short context is not cut into splits of less than two tiles
    assert interface.num_splits(_deepseek(1, keys=128), 64, 256, 32, sms=132) == 2


def test_gpu_plans_offer_both_accumulators(monkeypatch):
    monkeypatch.setattr(interface, "interpreting", lambda: False)
    d = _deepseek(64)
    base = interface.default_plan(d)
    assert (base.block_rows, base.block_dv, base.block_n, base.num_warps, base.num_stages) == (64, 512, 64, 8, 2)
    assert not base.transposed and interface.default_plan(_deepseek(64, heads=16)).transposed
    plans = interface.candidate_plans(d)
    assert plans[0] == base and len(plans) == len(set(plans)) <= 14
    assert any(p.block_dv == 512 for p in plans), "one value block (no score recomputation) is a candidate"
    assert any(p.block_dv < 512 for p in plans), "a split accumulator is a candidate"
    for p in plans:  # every one fits in shared memory (the estimate is what Triton reports on sm_90)
        assert interface._smem(d, p.block_rows, p.block_n, p.block_dv, p.num_stages) <= interface._smem_limit()


def test_supports_declines_prefill_and_wide_dims():
    def inv(t: int, dl: int, dr: int) -> dict:
        q = jax.ShapeDtypeStruct((2, t, 4, dl + dr), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((2, 64, dl + dr), jnp.bfloat16)
        return {"query": q, "kv": kv, "latent_dim": dl}

    assert supports(inv(16, 512, 64)) is None
    assert "T=17" in supports(inv(17, 512, 64))
    assert "Dl=1024" in supports(inv(1, 1024, 64))


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("page", [4, 16])  # a key tile (16 keys here) over several pages, and one inside a page
def test_table_entries_out_of_range_are_clamped_under_jit(transposed, page):
    rng = np.random.default_rng(0)
    b, t, h, dl, dr = 2, 2, 16, 16, 8
    lens = np.array([10, 7], np.int32)
    cache = rng.standard_normal((6, page, dl + dr)).astype(np.float32)
    q = rng.standard_normal((b, t, h, dl + dr)).astype(np.float32)
    tables = np.array([[0, 1, 99], [-5, 4, 3]], np.int32)  # 99 -> 5 and -5 -> 0 (pages in use)
    clamped = np.clip(tables, 0, 5)
    p = MlaDecodeParams(transposed=transposed)
    run = jax.jit(lambda q, c, tb, n: multi_head_latent_attention(q, c, latent_dim=dl, causal=True, block_tables=tb,
                                                                    cache_seqlens=n, fwd_params=p))  # fmt: skip
    got = run(q, cache, tables, lens)
    want = reference.multi_head_latent_attention(
        q, cache, latent_dim=dl, causal=True, block_tables=clamped, cache_seqlens=lens
    )
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_registered_above_xla_on_gpus():
    from ejkernel.kernels.registry import kernel_registry

    gpu = {i.name: i.priority for i in kernel_registry.implementations("multi_head_latent_attention", backend="gpu")}
    if "xla" in gpu:
        assert gpu["triton"] > gpu["xla"], gpu  # checked and timed on an H200: 4x XLA
    cpu = {i.name: i.priority for i in kernel_registry.implementations("multi_head_latent_attention", backend="cpu")}
    assert cpu["triton_interpret"] == 1
    for impl in kernel_registry.implementations("multi_head_latent_attention", backend="all"):
        if impl.platform == "triton":
            impl.resolve()  # the lazy references import, the signature fits the op's
