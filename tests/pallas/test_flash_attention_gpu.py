"""ejkernel-pallas Mosaic GPU flash attention (Hopper), against the float32 reference.

On a Hopper GPU the compiled kernel runs on multi-block shapes (several key blocks and query tiles,
lengths that are not multiples of the blocks, causal with T < S and T > S, GQA/MQA, D 64/128/256
and a padded D, bfloat16 and float16, every launch configuration), forward and gradients.

Without one, the same kernel runs in JAX's Mosaic GPU interpret mode on the CPU (smaller shapes: the
interpreter simulates every thread, barrier and copy). There its two matrix products are ``jnp.dot``
on the SMEM tiles instead of wgmma: the interpreter has neither ``run_state`` nor transposed wgmma
operands (see ``ejkernel_pallas.gpu.flash_attention._kernels``); the TMA copies, barriers, the
warpgroups' hand-offs, masking and the online softmax run as on the GPU. The conformance suite runs
the registered kernel on a GPU: ``pytest tests/conformance/test_flash_attention.py --ejkernel-platform=pallas``.
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("ejkernel_pallas") is None:
    pytest.skip("ejkernel-pallas is not installed", allow_module_level=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from ejkernel.device import first_gpu  # noqa: E402
from ejkernel.ops import Invocation  # noqa: E402
from ejkernel.ops.utils.datacarrier import BwdParams, FwdParams  # noqa: E402
from ejkernel.testing.conformance._harness import FWD_RTOL, GRAD_RTOL, assert_close, fresh_key  # noqa: E402
from ejkernel.testing.reference import flash_attention as reference  # noqa: E402

from ejkernel_pallas.gpu import flash_attention as gpu_fa  # noqa: E402

ON_GPU = (gpu := first_gpu()) is not None and gpu.has_capability(9, 0)  # a Hopper (or newer) GPU
# The kernel under test: compiled on a Hopper GPU, else in JAX's Mosaic GPU interpret mode.
KERNEL = gpu_fa.flash_attention if ON_GPU else gpu_fa.flash_attention_interpret

# (b, t, s, h, k, d, causal, dtype, (kv_blocksize, num_stages) or None)
GPU_CASES = [
    (2, 1000, 1000, 4, 2, 128, False, "bfloat16", None),
    (2, 1000, 1000, 4, 2, 128, True, "bfloat16", None),
    (1, 700, 1300, 4, 1, 128, True, "float16", (64, 3)),  # T < S, MQA
    (1, 1300, 700, 2, 2, 128, True, "bfloat16", (64, 4)),  # T > S: the first rows see no key
    (2, 777, 777, 4, 4, 64, True, "float16", None),
    (1, 1000, 1000, 2, 1, 64, False, "bfloat16", (128, 4)),
    (1, 520, 900, 2, 2, 256, True, "bfloat16", None),
    (1, 520, 900, 2, 1, 256, False, "float16", (64, 2)),
    (1, 333, 333, 2, 2, 80, True, "bfloat16", None),  # D padded to 128
]
INTERPRET_CASES = [
    (1, 130, 200, 2, 1, 64, True, "bfloat16", None),  # T < S, two query tiles, padded keys
    (1, 200, 130, 2, 2, 32, True, "float16", None),  # T > S, D padded to 64
    (2, 70, 300, 2, 1, 64, False, "bfloat16", (64, 3)),  # five key blocks through a three-slot ring
    (1, 256, 256, 1, 1, 128, True, "float16", (64, 2)),
    (1, 140, 140, 1, 1, 256, False, "bfloat16", None),
]
CASES = GPU_CASES if ON_GPU else INTERPRET_CASES


def _inputs(key, b, t, s, h, k, d, dtype):  # noqa: ANN001, ANN202
    kq, kk, kv, kc = jax.random.split(key, 4)
    q = jax.random.normal(kq, (b, t, h, d), jnp.float32).astype(dtype)
    k_ = jax.random.normal(kk, (b, s, k, d), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (b, s, k, d), jnp.float32).astype(dtype)
    cot = jax.random.normal(kc, (b, t, h, d), jnp.float32)
    return q, k_, v, cot


def _params(cfg):  # noqa: ANN001, ANN202
    return None if cfg is None else FwdParams(kv_blocksize=cfg[0], num_stages=cfg[1])


def _ids(case):  # noqa: ANN001, ANN202
    b, t, s, h, k, d, causal, dtype, cfg = case
    return f"B{b}T{t}S{s}H{h}K{k}D{d}{'-causal' if causal else ''}-{dtype}" + (f"-bk{cfg[0]}st{cfg[1]}" if cfg else "")


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_forward_matches_reference(case):
    b, t, s, h, k, d, causal, dtype, cfg = case
    key, seed = fresh_key()
    q, k_, v, _ = _inputs(key, b, t, s, h, k, d, dtype)
    out = jax.jit(lambda *a: KERNEL(*a, causal=causal, fwd_params=_params(cfg)))(q, k_, v)
    want = jax.jit(reference, static_argnames="causal")(q, k_, v, causal=causal)
    assert out.dtype == q.dtype
    assert_close(out, want, FWD_RTOL[dtype], f"{_ids(case)} forward", seed)


@pytest.mark.parametrize("case", CASES[:2] + CASES[3:4] + CASES[-2:-1], ids=_ids)
def test_gradients_match_reference(case):
    b, t, s, h, k, d, causal, dtype, cfg = case
    key, seed = fresh_key()
    q, k_, v, cot = _inputs(key, b, t, s, h, k, d, dtype)

    def grads(fn, **kw):  # noqa: ANN001, ANN003, ANN202
        loss = lambda *a: jnp.sum(fn(*a, causal=causal, **kw).astype(jnp.float32) * cot)  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k_, v)

    got = grads(KERNEL, fwd_params=_params(cfg), bwd_params=BwdParams(kv_blocksize=128))
    want = grads(reference)  # jitted inside grads
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert g.dtype == w.dtype
        assert_close(g, w, GRAD_RTOL[dtype], f"{_ids(case)} {name}", seed)


def test_a_config_over_shared_memory_is_refused():
    q = jnp.zeros((1, 128, 1, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="shared memory"):
        gpu_fa.flash_attention(q, q, q, fwd_params=FwdParams(kv_blocksize=128, num_stages=3))


@pytest.mark.parametrize(
    "params",
    [
        {"fwd_params": FwdParams(q_blocksize=64)},
        {"fwd_params": FwdParams(num_warps=4)},
        {"bwd_params": BwdParams(q_blocksize=64)},
        {"bwd_params": BwdParams(num_stages=2)},
    ],
    ids=["fwd_q_blocksize", "fwd_num_warps", "bwd_q_blocksize", "bwd_num_stages"],
)
def test_launch_fields_it_does_not_take_are_refused(params):
    q = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="pallas:gpu"):
        gpu_fa.flash_attention(q, q, q, **params)


def test_vmap_folds_into_the_batch():
    key, seed = fresh_key()
    q, k_, v, _ = _inputs(key, 2, 130, 130, 2, 1, 64, "bfloat16")
    got = jax.vmap(lambda *a: KERNEL(*a, causal=True))(*(x[:, None] for x in (q, k_, v)))[:, 0]
    want = jax.jit(reference, static_argnames="causal")(q, k_, v, causal=True)
    assert_close(got, want, FWD_RTOL["bfloat16"], "vmap", seed)


def _inv(s=8, **kw):  # noqa: ANN001, ANN003, ANN202
    q = jax.ShapeDtypeStruct((1, 8, 2, kw.pop("d", 64)), kw.pop("dtype", jnp.bfloat16))
    v = jax.ShapeDtypeStruct((1, s, 1, kw.pop("dv", q.shape[-1])), q.dtype)
    args = {"query": q, "key": jax.ShapeDtypeStruct((1, s, 1, q.shape[-1]), q.dtype), "value": v, **kw}
    return Invocation.create("flash_attention", args, "cpu")


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"dtype": jnp.float32}, "float32"),
        ({"bias": jnp.zeros((1, 2, 8, 8))}, "bias"),
        ({"attention_mask": jnp.ones((1, 1, 8, 8), bool)}, "attention_mask"),
        ({"q_segment_ids": jnp.zeros((1, 8), jnp.int32)}, "segment ids"),
        ({"sliding_window": (4, 4)}, "sliding_window"),
        ({"logits_soft_cap": 2.0}, "logits_soft_cap"),
        ({"dropout_prob": 0.1}, "dropout"),
        ({"cu_seqlens_q": jnp.array([0, 8])}, "cu_seqlens"),
        ({"dv": 32}, "Dv=32"),
        ({"d": 320}, "D=320"),
    ],
)
def test_supports_names_what_it_declines(kwargs, reason):
    got = gpu_fa.supports(_inv(**kwargs))
    assert got is not None and reason in got, got


def test_supports_serves_the_plain_call():
    assert gpu_fa.supports(_inv()) is None
    assert gpu_fa.supports(_inv(dtype=jnp.float16, d=256, causal=True)) is None


def test_candidates_fit_shared_memory_and_registers():
    from ejkernel_pallas.gpu.flash_attention.interface import _SMEM_LIMIT

    for d in (64, 128, 256):
        inv = _inv(s=8192, d=d)
        cands = gpu_fa.candidate_cfgs(inv, "fwd")
        assert gpu_fa.heuristic_cfg(inv, "fwd") in cands
        assert len(cands) >= (1 if d == 256 else 3), cands  # D=256: only 64-key blocks, two stages fit
        for c in cands:
            smem = (128 * d + 2 * c.num_stages * c.kv_blocksize * d) * 2 + 512
            assert smem <= _SMEM_LIMIT and c.kv_blocksize + d <= 384, (d, c)
