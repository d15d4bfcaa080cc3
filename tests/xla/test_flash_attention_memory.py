"""The XLA blockwise flash attention: every option against the dense reference, and its O(T) memory.

Small shapes with block sizes that divide nothing (T, S not multiples of the blocks), so that padding,
partial blocks and block skipping are all exercised. Inputs are fresh each run; set
``EJKERNEL_TEST_SEED`` to the seed a failure names to reproduce it.
"""

from __future__ import annotations

import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.ops.utils.datacarrier import BwdParams, FwdParams
from ejkernel.testing.reference import flash_attention as reference

from ejkernel_xla.flash_attention import flash_attention
from ejkernel_xla.flash_attention._blockwise import Options, _Ctx, forward

SEED = int(os.environ.get("EJKERNEL_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
CU_Q = (0, 9, 9, 24, 31)  # an empty sequence, and T=37 leaves 6 padding rows outside every sequence
CU_K = (0, 5, 20, 39, 50)

CASES: dict[str, dict] = {
    "gqa": {},
    "mqa_causal_t_gt_s": {"K": 1, "T": 45, "S": 29, "causal": True},  # the first 16 rows see no key
    "window_int_causal": {"sliding_window": 4, "causal": True},
    "mha_dv_bias_softcap_scale": {"K": 4, "Dv": 8, "bias": (2, 4), "logits_soft_cap": 2.0, "softmax_scale": 0.3},
    "bias_batch_only_window": {"bias": (2, 1), "sliding_window": (9, 2)},
    "mask_and_segments": {"mask": True, "segments": True},
    "varlen_causal": {"B": 1, "varlen": True, "causal": True},
    "varlen_window_dropout": {"B": 1, "varlen": True, "sliding_window": (3, 1), "dropout_prob": 0.2, "dropout_seed": 5},
    "all_options_array_seed": {"bias": (1, 4), "causal": True, "logits_soft_cap": 5.0, "mask": True, "segments": True,
                               "dropout_prob": 0.2, "dropout_seed": "array"},
    "bfloat16_causal": {"dtype": jnp.bfloat16, "causal": True},
    "float16_broadcast_bias": {"dtype": jnp.float16, "bias": (1, 1)},
}  # fmt: skip


def _inputs(name: str, c: dict) -> tuple[dict, dict]:
    b, t, s, h, kh = c.get("B", 2), c.get("T", 37), c.get("S", 53), 4, c.get("K", 2)
    d, dv, dtype = 16, c.get("Dv", 24), c.get("dtype", jnp.float32)
    rng = np.random.default_rng([SEED, zlib.crc32(name.encode())])
    arr = {
        "query": jnp.asarray(rng.standard_normal((b, t, h, d)), dtype),
        "key": jnp.asarray(rng.standard_normal((b, s, kh, d)), dtype),
        "value": jnp.asarray(rng.standard_normal((b, s, kh, dv)), dtype),
        "bias": None,
        "dout": jnp.asarray(rng.standard_normal((b, t, h, dv)), jnp.float32),
    }
    if "bias" in c:
        arr["bias"] = jnp.asarray(rng.standard_normal((*c["bias"], t, s)), dtype)
    kw: dict = {
        k: c[k] for k in ("causal", "sliding_window", "logits_soft_cap", "softmax_scale", "dropout_prob") if k in c
    }
    if "dropout_seed" in c:
        kw["dropout_seed"] = jnp.int32(11) if c["dropout_seed"] == "array" else c["dropout_seed"]
    if c.get("mask"):
        mask = rng.random((b, 1, t, s)) < 0.7
        mask[:, :, 4] = False  # fully masked rows: zeros, never NaN
        kw["attention_mask"] = jnp.asarray(mask)
    if c.get("segments"):
        kw["q_segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, (b, t)), axis=1), jnp.int32)
        kw["kv_segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, (b, s)), axis=1), jnp.int32)
    if c.get("varlen"):
        kw["cu_seqlens_q"] = jnp.asarray(CU_Q, jnp.int32)
        kw["cu_seqlens_k"] = jnp.asarray(CU_K, jnp.int32)
    return arr, kw


def _loss(fn, arr, kw):
    def loss(q, k, v, bias):
        out = fn(q, k, v, bias, **kw)
        return jnp.sum(out.astype(jnp.float32) * arr["dout"]), out

    argnums = (0, 1, 2, 3) if arr["bias"] is not None else (0, 1, 2)
    return jax.value_and_grad(loss, argnums=argnums, has_aux=True)


def _close(name: str, got, want, tol: float) -> None:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all(), f"{name}: not finite (EJKERNEL_TEST_SEED={SEED})"
    scale = max(1.0, float(np.abs(want).max()))
    err = float(np.abs(got - want).max())
    assert err <= tol * scale, f"{name}: max error {err:.3g} > {tol * scale:.3g} (EJKERNEL_TEST_SEED={SEED})"


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name: str) -> None:
    c = CASES[name]
    arr, kw = _inputs(name, c)
    tol = 2e-5 if c.get("dtype", jnp.float32) == jnp.float32 else 3e-2
    params = {
        "fwd_params": FwdParams(q_blocksize=16, kv_blocksize=8),
        "bwd_params": BwdParams(q_blocksize=8, kv_blocksize=16),
    }

    def ours(q, k, v, bias, **kw):
        return flash_attention(q, k, v, bias, **kw, **params)

    # The array arguments are traced (a traced dropout seed and traced cu_seqlens included).
    arrays = {k: v for k, v in kw.items() if isinstance(v, jax.Array)}
    static = {k: v for k, v in kw.items() if k not in arrays}
    run = jax.jit(lambda q, k, v, bias, arrays: _loss(ours, arr, {**static, **arrays})(q, k, v, bias))
    (_, out), grads = run(arr["query"], arr["key"], arr["value"], arr["bias"], arrays)
    want = jax.jit(lambda q, k, v, bias, arrays: _loss(reference, arr, {**static, **arrays})(q, k, v, bias))
    (_, want_out), want_grads = want(arr["query"], arr["key"], arr["value"], arr["bias"], arrays)
    assert out.dtype == arr["query"].dtype and out.shape == want_out.shape
    _close("out", out, want_out, tol)
    for what, g, w in zip(("dq", "dk", "dv", "dbias"), grads, want_grads, strict=False):
        assert g.shape == w.shape and g.dtype == w.dtype, what
        _close(what, g, w, tol)
    if "attention_mask" in kw:
        assert not np.asarray(out[:, 4], np.float32).any(), "a fully masked row must give zeros"


def test_lse() -> None:
    """The forward's log-sum-exp equals the reference's, ``-inf`` exactly on rows without keys."""
    arr, call = _inputs("lse", {"B": 1, "varlen": True, "causal": True})
    o = Options(scale=16**-0.5, causal=call.get("causal", False), window=call.get("sliding_window"), fwd_blocks=(16, 8))
    arrays = (arr["query"], arr["key"], arr["value"], None, None, None, None, None,
              call.get("cu_seqlens_q"), call.get("cu_seqlens_k"), None, None)  # fmt: skip
    out, lse = jax.jit(forward, static_argnums=0)(o, arrays)
    want_out, want_lse = reference(arr["query"], arr["key"], arr["value"], **call, return_lse=True)
    _close("out", out, want_out, 2e-5)
    assert np.isneginf(want_lse).any() and (np.isneginf(lse) == np.isneginf(want_lse)).all()
    _close("lse", jnp.where(jnp.isinf(want_lse), 0, lse), jnp.where(jnp.isinf(want_lse), 0, want_lse), 2e-5)


@pytest.mark.parametrize(
    ("kw", "lengths", "visited", "unmasked"),
    [
        ({}, {}, 64, 64),
        ({"causal": True}, {}, 36, 28),
        ({"window": (256, 0)}, {}, 21, 7),
        ({"window": (100, 100)}, {}, 22, 0),
        # Key lengths 300 and 640: every query block visits the 5 blocks below 640, 2 (below 300) whole.
        ({}, {"kvlen": [300, 640]}, 40, 16),
        # Prefix-LM, prefixes 256 and 384: the causal triangle widened to the prefix blocks (3 visited by the first
        # three query blocks, 2 of them whole: the shorter prefix bounds what every sequence sees whole).
        ({"causal": True}, {"prefix": [256, 384]}, 39, 31),
    ],
)
def test_only_admissible_blocks_are_visited(kw: dict, lengths: dict, visited: int, unmasked: int) -> None:
    """8 x 8 blocks of 128: causal visits the 36 of the lower triangle, 28 of them without mask arithmetic."""
    x = jnp.zeros((2, 1024, 2, 8), jnp.float32)
    per_batch = tuple(None if n not in lengths else jnp.array(lengths[n]) for n in ("kvlen", "prefix"))
    arrays = (x, x, x, None, None, None, None, None, None, None, *per_batch)
    c = _Ctx(Options(scale=1.0, **kw), arrays, (128, 128), kvm=False)
    assert int((c.kv_hi - c.kv_lo).sum()) == visited and int((c.kv_fhi - c.kv_flo).sum()) == unmasked
    kv = _Ctx(Options(scale=1.0, **kw), arrays, (128, 128), kvm=True)
    assert int((kv.q_hi - kv.q_lo).sum()) == visited and int((kv.q_fhi - kv.q_flo).sum()) == unmasked


def test_vmap_of_grad_with_batched_seed_and_cu_seqlens() -> None:
    rng = np.random.default_rng([SEED, 0])
    q = jnp.asarray(rng.standard_normal((3, 1, 20, 4, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((3, 1, 30, 2, 8)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((3, 1, 30, 2, 8)), jnp.float32)
    seeds = jnp.arange(3, dtype=jnp.int32)
    cu_q = jnp.asarray([[0, 5, 20, 20], [0, 10, 12, 18], [0, 0, 7, 20]], jnp.int32)
    cu_k = jnp.asarray([[0, 10, 30, 30], [0, 3, 12, 25], [0, 1, 2, 30]], jnp.int32)
    opts = {"dropout_prob": 0.4, "sliding_window": (4, 1), "causal": True}

    def ours(q, k, v, s, cq, ck):
        p = {"fwd_params": FwdParams(8, 8), "bwd_params": BwdParams(8, 16)}
        return flash_attention(q, k, v, dropout_seed=s, cu_seqlens_q=cq, cu_seqlens_k=ck, **opts, **p).sum()

    def ref(q, k, v, s, cq, ck):
        return reference(q, k, v, dropout_seed=s, cu_seqlens_q=cq, cu_seqlens_k=ck, **opts).sum()

    got = jax.jit(jax.vmap(jax.value_and_grad(ours, argnums=(0, 1, 2))))(q, k, v, seeds, cu_q, cu_k)
    want = jax.jit(jax.vmap(jax.value_and_grad(ref, argnums=(0, 1, 2))))(q, k, v, seeds, cu_q, cu_k)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        _close("vmap", g, w, 2e-5)


def test_through_the_public_api() -> None:
    from ejkernel.modules import flash_attention as public

    rng = np.random.default_rng([SEED, 1])
    q = jnp.asarray(rng.standard_normal((1, 40, 4, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 40, 1, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((1, 40, 1, 16)), jnp.float32)
    got = jax.jit(jax.grad(lambda q, k, v: public(q, k, v, causal=True, platform="xla").sum()))(q, k, v)
    want = jax.grad(lambda q: reference(q, k, v, causal=True).sum())(q)
    _close("dq", got, want, 2e-5)


def _temp_bytes(t: int, block: int = 256, h: int = 4, d: int = 64, causal: bool = False) -> int:
    x = jax.ShapeDtypeStruct((1, t, h, d), jnp.float32)
    params = {"fwd_params": FwdParams(block, block), "bwd_params": BwdParams(block, block)}

    def loss(q, k, v):
        return flash_attention(q, k, v, causal=causal, **params).sum()

    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def test_training_memory_is_linear_in_length() -> None:
    """Forward+backward never holds a T x S matrix: temp memory is far below it and grows linearly."""
    h, t = 4, 8192
    small, large = _temp_bytes(t // 2, h=h), _temp_bytes(t, h=h, causal=True)
    dense_scores = 1 * h * t * t * 4  # one float32 score matrix of the dense algorithm: 1 GiB
    assert large < dense_scores / 8, f"temp {large / 2**20:.1f} MiB vs dense scores {dense_scores / 2**20:.0f} MiB"
    # Doubling T doubles the O(T) buffers (plus a constant for the block tiles); quadratic would be 4x.
    assert large / small < 2.2, f"temp grew {large / small:.2f}x when T doubled"
