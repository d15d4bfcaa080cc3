"""ejkernel-triton flash attention in Triton's interpreter (CPU) against the float32 reference.

Every test draws fresh random inputs (the seed is in the failure message) and compares the output,
the log-sum-exp and the gradients (dq, dk, dv, dbias: ``jax.vjp`` of the kernel against
``jax.vjp`` of ``ejkernel.testing.reference.flash_attention``).

Tolerances (max abs error <= atol + rtol * max |reference|):

* float32: 1e-4 / 1e-4 (the interpreter's dots are numpy float32 matmuls; observed ~1e-6);
* float16: 1e-2 / 1e-2; bfloat16: 3e-2 / 3e-2 (P and dS are rounded to the input dtype before the
  second and third dots, as on the GPU's tensor cores, and the outputs are in the input dtype).

Blocks are 16 x 16 so that small shapes still span several blocks (ragged ends, masked and
unmasked tiles, skipped tiles).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed: the Triton interpreter tests need it", allow_module_level=True)

# Before anything imports triton: Triton decorates its own tl.* helpers at import time.
os.environ["EJKERNEL_TRITON_INTERPRET"] = "1"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ejkernel.kernels.signatures._attention import dropout_keep  # noqa: E402
from ejkernel.ops.utils.datacarrier import BwdParams, FwdParams  # noqa: E402
from ejkernel.testing.reference import flash_attention as reference  # noqa: E402

from ejkernel_triton import launch  # noqa: E402
from ejkernel_triton.flash_attention import candidate_cfgs, flash_attention, heuristic_cfg, supports  # noqa: E402
from ejkernel_triton.flash_attention.interface import _DEFAULTS as _INTERFACE_DEFAULTS  # noqa: E402
from ejkernel_triton.flash_attention.interface import (  # noqa: E402
    _backward,
    _forward,
    _forward_with_lse,
    _prepare,
)

if not launch.INTERPRET or launch.INTERPRET_PROBLEM:
    pytest.skip(
        "triton or ejkernel_triton was imported before EJKERNEL_TRITON_INTERPRET=1 was set in this process "
        f"({launch.INTERPRET_PROBLEM or 'the kernels are compiled for the GPU'}); run this module in its own "
        "process, or set EJKERNEL_TRITON_INTERPRET=1 in the environment",
        allow_module_level=True,
    )

FP = FwdParams(q_blocksize=16, kv_blocksize=16)
BP = BwdParams(q_blocksize=16, kv_blocksize=16)
TOL = {jnp.float32: (1e-4, 1e-4), jnp.float16: (1e-2, 1e-2), jnp.bfloat16: (3e-2, 3e-2)}


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng()


def _seed_of(rng: np.random.Generator) -> int:
    return int(rng.bit_generator.seed_seq.entropy)  # type: ignore[attr-defined]


def _normal(rng: np.random.Generator, shape: tuple[int, ...], dtype=jnp.float32, scale: float = 1.0) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * scale).astype(dtype)


def _qkv(rng, b, t, s, h, kh, d, dv=None, dtype=jnp.float32):
    dv = d if dv is None else dv
    return _normal(rng, (b, t, h, d), dtype), _normal(rng, (b, s, kh, d), dtype), _normal(rng, (b, s, kh, dv), dtype)


def _close(name: str, got: jax.Array, want: jax.Array, dtype, rng) -> None:
    got = np.asarray(jnp.asarray(got, jnp.float32))
    want = np.asarray(jnp.asarray(want, jnp.float32))
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    assert not np.isnan(got).any(), f"{name}: NaN in the kernel's result (seed {_seed_of(rng)})"
    atol, rtol = TOL[dtype]
    finite = np.isfinite(want)
    np.testing.assert_array_equal(
        got[~finite], want[~finite], err_msg=f"{name}: infinities differ (seed {_seed_of(rng)})"
    )
    err = np.abs(got[finite] - want[finite]).max(initial=0.0)
    bound = atol + rtol * np.abs(want[finite]).max(initial=0.0)
    assert err <= bound, f"{name}: max abs error {err:.3g} > {bound:.3g} (seed {_seed_of(rng)})"


def check(rng, q, k, v, bias=None, *, bwd_params=BP, **kw) -> tuple[jax.Array, jax.Array]:
    """Compare output, lse and every gradient with the reference; returns (out, lse).

    To keep the interpreter's time down this drives the custom_vjp's two halves directly (one
    forward, whose residuals feed the backward); ``test_custom_vjp_*`` cover the jax.custom_vjp
    wiring through jax.grad / jax.jit."""
    dtype = q.dtype.type
    cfg, aux = _prepare(q, k, v, bias, **{**_DEFAULTS, **kw, "fwd_params": FP, "bwd_params": bwd_params})
    out, lse = _forward(cfg, q, k, v, bias, aux)
    ref_out, ref_lse = reference(q, k, v, bias, return_lse=True, **kw)
    assert out.dtype == q.dtype and lse.dtype == jnp.float32
    _close("out", out, ref_out, dtype, rng)
    _close("lse", lse, ref_lse, jnp.float32 if dtype is jnp.float32 else dtype, rng)
    args = (q, k, v) if bias is None else (q, k, v, bias)
    _, ref_vjp = jax.vjp(lambda *a: reference(*a, **kw), *args)
    g = _normal(rng, out.shape, out.dtype)
    grads = _backward(cfg, (q, k, v, bias, aux, out, lse), g)
    for name, got, want, x in zip(("dq", "dk", "dv", "dbias"), grads, ref_vjp(g), args):
        assert got.shape == x.shape and got.dtype == x.dtype, f"{name}: {got.dtype}{got.shape} != {x.dtype}{x.shape}"
        _close(name, got, want, dtype, rng)
    return out, lse


# The options' defaults, as the interface keeps them (launch params are passed separately).
_DEFAULTS = {k: v for k, v in _INTERFACE_DEFAULTS.items() if k not in ("fwd_params", "bwd_params")}


# ------------------------------------------------------------------------------------------------
# Masks and layouts, float32.
# ------------------------------------------------------------------------------------------------


def test_plain_ragged_lengths(rng):
    check(rng, *_qkv(rng, 2, 37, 53, 2, 2, 32))


@pytest.mark.parametrize("t,s", [(37, 53), (50, 30)], ids=["T<S", "T>S"])
def test_causal_bottom_right(rng, t, s):
    # T > S: the first T - S rows see no key (bottom-right alignment): zeros, lse -inf, zero grads
    out, lse = check(rng, *_qkv(rng, 1, t, s, 2, 2, 32), causal=True)
    if t > s:
        assert not np.asarray(out[:, : t - s]).any() and np.isneginf(np.asarray(lse[:, :, : t - s])).all()


@pytest.mark.parametrize(
    "bwd_params",
    [BwdParams(q_blocksize=16, kv_blocksize=32), BwdParams(q_blocksize=32, kv_blocksize=16)],
    ids=["stream16_hold32", "stream32_hold16"],
)
def test_backward_tile_rule(rng, bwd_params):
    # the dK/dV kernel holds kv_blocksize keys, the dQ kernel kv_blocksize queries (interface._backward):
    # unequal blocks on ragged causal shapes, both ways round
    check(rng, *_qkv(rng, 1, 45, 70, 2, 1, 32), bwd_params=bwd_params, causal=True)


@pytest.mark.parametrize(
    "window,causal", [((9, 4), False), (6, True), ((0, 0), False)], ids=["w9_4", "w6_causal", "w0_0"]
)
def test_sliding_window(rng, window, causal):
    check(rng, *_qkv(rng, 1, 48, 61, 2, 1, 32), sliding_window=window, causal=causal)


def test_soft_cap_with_scale(rng):
    q, k, v = _qkv(rng, 1, 33, 40, 2, 2, 32)
    check(rng, q * 4, k * 4, v, logits_soft_cap=5.0, softmax_scale=0.3)


@pytest.mark.parametrize("bias_shape", ["full", "bcast_batch", "bcast_head", "bcast_both"])
def test_bias_and_dbias(rng, bias_shape):
    b, t, s, h = 2, 35, 41, 2
    shape = {"full": (b, h, t, s), "bcast_batch": (1, h, t, s), "bcast_head": (b, 1, t, s), "bcast_both": (1, 1, t, s)}[
        bias_shape
    ]
    check(rng, *_qkv(rng, b, t, s, h, 1, 32), _normal(rng, shape), causal=bias_shape == "bcast_head")


def test_bias_with_minus_inf(rng):
    # -inf in the bias masks like attention_mask does; a whole -inf row has lse -inf and must give
    # zeros and finite (zero) gradients in the backward too
    b, t, s, h = 1, 33, 40, 2
    bias = _normal(rng, (b, h, t, s))
    bias = jnp.where(jnp.asarray(rng.random((b, h, t, s)) < 0.3), -jnp.inf, bias)
    bias = bias.at[:, :, 7].set(-jnp.inf)
    q, k, v = _qkv(rng, b, t, s, h, 1, 32)
    cfg, aux = _prepare(q, k, v, bias, **{**_DEFAULTS, "fwd_params": FP, "bwd_params": BP})
    out, lse = _forward(cfg, q, k, v, bias, aux)
    ref_out, ref_lse = reference(q, k, v, bias, return_lse=True)
    _close("out", out, ref_out, jnp.float32, rng)
    _close("lse", lse, ref_lse, jnp.float32, rng)
    assert not np.asarray(out[:, 7]).any()
    g = _normal(rng, out.shape)
    dq, dk, dv, dbias = _backward(cfg, (q, k, v, bias, aux, out, lse), g)
    _, ref_vjp = jax.vjp(lambda q, k, v: reference(q, k, v, bias), q, k, v)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_vjp(g)):
        _close(name, got, want, jnp.float32, rng)
    assert np.isfinite(np.asarray(dbias)).all() and not np.asarray(dbias[:, :, 7]).any()
    assert not np.asarray(jnp.where(jnp.isinf(bias), dbias, 0.0)).any()


def test_bias_soft_cap_window(rng):
    b, t, s, h = 1, 40, 40, 2
    check(
        rng,
        *_qkv(rng, b, t, s, h, 2, 32),
        _normal(rng, (b, h, t, s), scale=2.0),
        logits_soft_cap=3.0,
        sliding_window=(10, 10),
    )


def test_boolean_mask_with_fully_masked_row(rng):
    b, t, s, h = 2, 33, 45, 2
    mask = jnp.asarray(rng.random((b, 1, t, s)) < 0.7)
    mask = mask.at[0, 0, 5].set(False).at[1, 0, 20].set(False)  # rows with no admitted key
    q, k, v = _qkv(rng, b, t, s, h, 2, 32)
    out, lse = check(rng, q, k, v, attention_mask=mask)
    assert not np.asarray(out[0, 5]).any() and not np.asarray(out[1, 20]).any()
    assert np.isneginf(np.asarray(lse[0, :, 5])).all()
    dq = jax.grad(lambda q: flash_attention(q, k, v, attention_mask=mask, fwd_params=FP, bwd_params=BP).sum())(q)
    assert not np.asarray(dq[0, 5]).any() and np.isfinite(np.asarray(dq)).all()


def test_segment_ids(rng):
    b, t, s = 2, 40, 52
    q_seg = jnp.asarray(np.sort(rng.integers(0, 4, (b, t)), axis=1), jnp.int32)
    kv_seg = jnp.asarray(np.sort(rng.integers(0, 4, (b, s)), axis=1), jnp.int32)
    check(rng, *_qkv(rng, b, t, s, 2, 2, 32), q_segment_ids=q_seg, kv_segment_ids=kv_seg, causal=True)


@pytest.mark.parametrize("mode", ["plain", "causal", "window"])
def test_varlen(rng, mode):
    # three packed sequences; the last 4 query rows and 3 keys belong to none (they attend nothing)
    cu_q = jnp.asarray([0, 11, 36, 60], jnp.int32)
    cu_k = jnp.asarray([0, 20, 31, 70], jnp.int32)
    kw = {"plain": {}, "causal": {"causal": True}, "window": {"sliding_window": (5, 2), "causal": False}}[mode]
    out, _ = check(rng, *_qkv(rng, 1, 64, 73, 2, 1, 32), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kw)
    assert not np.asarray(out[0, 60:]).any()


# ------------------------------------------------------------------------------------------------
# Dropout: the keep mask is the shared hash, so the kernel reproduces the reference bit for bit.
# ------------------------------------------------------------------------------------------------


def test_dropout_mask_is_bit_exact(rng):
    # With v = identity (Dv = S) the output *is* the dropped probability matrix: its zero pattern
    # is exactly the keep mask, which must match dropout_keep for every (b, h, i, j).
    b, t, s, h, p = 2, 24, 40, 2, 0.3
    seed = int(rng.integers(0, 2**32))
    q = _normal(rng, (b, t, h, 32), scale=0.3)
    k = _normal(rng, (b, s, 1, 32), scale=0.3)
    v = jnp.broadcast_to(jnp.eye(s, dtype=jnp.float32)[None, :, None, :], (b, s, 1, s))
    out, _ = _forward_with_lse(q, k, v, dropout_prob=p, dropout_seed=seed, fwd_params=FP)
    bi, hi, ti, si = np.ix_(np.arange(b), np.arange(h), np.arange(t), np.arange(s))
    keep = dropout_keep(seed, bi, hi, ti, si, h, p)  # [B, H, T, S]
    np.testing.assert_array_equal(np.asarray(out).transpose(0, 2, 1, 3) != 0, keep, err_msg=f"seed {seed}")
    ref = reference(q, k, v, dropout_prob=p, dropout_seed=jnp.asarray(np.uint32(seed)))  # (a Python int >= 2**31
    # would overflow the reference's int32 conversion; the kernel takes any int)
    _close("out", out, ref, jnp.float32, rng)


@pytest.mark.parametrize("seed_kind", ["int", "uint32_array", "int32_array_jit"])
def test_dropout_forward_and_grads(rng, seed_kind):
    b, t, s, h = 1, 37, 45, 2
    raw = int(rng.integers(0, 2**31))
    seed = {"int": raw, "uint32_array": jnp.uint32(raw), "int32_array_jit": jnp.int32(raw)}[seed_kind]
    q, k, v = _qkv(rng, b, t, s, h, 1, 32)
    if seed_kind == "int32_array_jit":  # the seed as a traced array under jit
        fn = jax.jit(
            lambda q, k, v, sd: flash_attention(
                q, k, v, causal=True, dropout_prob=0.2, dropout_seed=sd, fwd_params=FP, bwd_params=BP
            )
        )
        out = fn(q, k, v, seed)
        _close("out", out, reference(q, k, v, causal=True, dropout_prob=0.2, dropout_seed=seed), jnp.float32, rng)
        dq = jax.jit(jax.grad(lambda q, sd: fn(q, k, v, sd).sum()))(q, seed)
        ref_dq = jax.grad(lambda q: reference(q, k, v, causal=True, dropout_prob=0.2, dropout_seed=seed).sum())(q)
        _close("dq", dq, ref_dq, jnp.float32, rng)
    else:
        check(rng, q, k, v, _normal(rng, (1, h, t, s)), causal=True, dropout_prob=0.2, dropout_seed=seed)


# ------------------------------------------------------------------------------------------------
# Heads, head dims, lengths, dtypes.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("h,kh", [(4, 2), (4, 1)], ids=["GQA", "MQA"])
def test_gqa_mqa(rng, h, kh):
    check(rng, *_qkv(rng, 1, 29, 35, h, kh, 32), causal=True)


@pytest.mark.parametrize(
    "d,dv", [(64, 64), (32, 48), (64, 16), (200, 136)], ids=["D64", "D32_Dv48", "D64_Dv16", "D200_Dv136"]
)
def test_head_dims(rng, d, dv):
    check(rng, *_qkv(rng, 1, 30, 40, 2, 1, d, dv), causal=d != dv)


@pytest.mark.parametrize("causal", [False, True])
def test_single_query(rng, causal):
    # T = 1 (decoding): with bottom-right alignment the one query sees every key even when causal
    check(rng, *_qkv(rng, 2, 1, 33, 2, 1, 32), causal=causal)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
def test_half_precision(rng, dtype):
    b, t, s, h = 1, 45, 60, 2
    q, k, v = _qkv(rng, b, t, s, h, 1, 64, dtype=dtype)
    check(rng, q, k, v, _normal(rng, (1, h, t, s), dtype), causal=True, logits_soft_cap=20.0)


def test_half_precision_varlen_dropout(rng):
    cu = jnp.asarray([0, 17, 40], jnp.int32)
    q, k, v = _qkv(rng, 1, 40, 40, 2, 2, 32, dtype=jnp.bfloat16)
    check(rng, q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, dropout_prob=0.1, dropout_seed=7)


def test_custom_vjp_under_jit_default_params(rng):
    # the public function end to end: jax.custom_vjp through jax.grad under jax.jit, with no launch
    # parameters (the interpreter's default blocks)
    t, s = 70, 80
    q, k, v = _qkv(rng, 1, t, s, 2, 1, 32)
    bias = _normal(rng, (1, 1, t, s))
    g = _normal(rng, (1, t, 2, 32))

    def loss(f):
        return lambda q, k, v, b: (f(q, k, v, b, causal=True) * g).sum()

    out = jax.jit(lambda *a: flash_attention(*a, causal=True))(q, k, v, bias)
    _close("out", out, reference(q, k, v, bias, causal=True), jnp.float32, rng)
    got = jax.jit(jax.grad(loss(flash_attention), argnums=(0, 1, 2, 3)))(q, k, v, bias)
    want = jax.grad(loss(reference), argnums=(0, 1, 2, 3))(q, k, v, bias)
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), got, want):
        _close(name, a, b, jnp.float32, rng)


def test_vmap_and_grad_of_vmap(rng):
    # jax-triton's primitive refuses vmap: the interface folds the vmapped axis into the batch (k, v broadcast)
    q = _normal(rng, (3, 1, 17, 2, 16))  # vmapped axis first; k, v shared (not batched)
    k, v = _normal(rng, (1, 21, 1, 16)), _normal(rng, (1, 21, 1, 16))
    f = lambda q: flash_attention(q, k, v, causal=True, fwd_params=FP, bwd_params=BP)  # noqa: E731
    r = lambda q: reference(q, k, v, causal=True)  # noqa: E731
    _close("vmap out", jax.vmap(f)(q), jax.vmap(r)(q), jnp.float32, rng)
    g = jax.grad(lambda q: (jax.vmap(f)(q) ** 2).sum())(q)
    _close("grad of vmap", g, jax.grad(lambda q: (jax.vmap(r)(q) ** 2).sum())(q), jnp.float32, rng)


def _vmapped_grads(f, g, in_axes, *args):
    """``vmap(f, in_axes)`` and its gradients in q, k, v, bias against the cotangent ``g``."""
    loss = lambda *a: (jax.vmap(f, in_axes)(*a).astype(jnp.float32) * g).sum()  # noqa: E731
    return jax.vmap(f, in_axes)(*args), jax.grad(loss, argnums=(0, 1, 2, 3))(*args)


@pytest.mark.parametrize("case", ["per_row", "shared_bias", "dropout"])
def test_vmap_folds_into_the_batch(rng, monkeypatch, case):
    # per_row: every kernel launches once over the V * B folded rows (bias and segment ids per row).
    # shared_bias: a bias shared by the batch ([1, ...] against B > 1) folds in the forward, but its
    # gradient is a sum over the batch: the backward runs per element. dropout: the hash reads the
    # batch index, so every launch runs per element.
    v_, b, t, s, h = 2, 2, 17, 21, 2
    batches: list = []  # the batch (first array's leading dim) of every launch the interpreter ran
    real_callback = jax.pure_callback

    def recording_callback(host, *a, **kw):
        return real_callback(lambda *xs: batches.append(xs[0].shape[0]) or host(*xs), *a, **kw)

    monkeypatch.setattr(jax, "pure_callback", recording_callback)
    q, k, v = (x.reshape(v_, b, *x.shape[1:]) for x in _qkv(rng, v_ * b, t, s, h, 1, 16))
    kw: dict = dict(causal=True)
    if case == "per_row":
        bias = _normal(rng, (v_, b, 1, t, s))
        q_seg = jnp.sort(jnp.asarray(rng.integers(0, 2, (v_, b, t)), jnp.int32), axis=-1)
        kv_seg = jnp.sort(jnp.asarray(rng.integers(0, 2, (v_, b, s)), jnp.int32), axis=-1)
        args, in_axes = (q, k, v, bias, q_seg, kv_seg), 0

        def call(fa, q, k, v, bias, q_seg, kv_seg, **x):
            return fa(q, k, v, bias, q_segment_ids=q_seg, kv_segment_ids=kv_seg, **kw, **x)

    else:
        args, in_axes = (q, k, v, _normal(rng, (1, 1, t, s))), (0, 0, 0, None)
        if case == "dropout":
            kw.update(dropout_prob=0.25, dropout_seed=5)

        def call(fa, q, k, v, bias, **x):
            return fa(q, k, v, bias, **kw, **x)

    g = _normal(rng, q.shape)
    out, grads = _vmapped_grads(lambda *a: call(flash_attention, *a, fwd_params=FP, bwd_params=BP), g, in_axes, *args)
    want_out, want_grads = _vmapped_grads(lambda *a: call(reference, *a), g, in_axes, *args)
    _close("vmap out", out, want_out, jnp.float32, rng)
    for name, got, want in zip(("dq", "dk", "dv", "dbias"), grads, want_grads):
        _close(name, got, want, jnp.float32, rng)
    assert set(batches) == {"per_row": {v_ * b}, "shared_bias": {v_ * b, b}, "dropout": {b}}[case], batches


# ------------------------------------------------------------------------------------------------
# Configs, supports, argument checks.
# ------------------------------------------------------------------------------------------------


class _Inv:
    def __init__(self, **arguments):
        self.arguments = arguments


def _inv(d=128, dv=None, dtype=jnp.bfloat16, t=4096, s=4096):
    dv = d if dv is None else dv
    sds = jax.ShapeDtypeStruct
    return _Inv(query=sds((2, t, 16, d), dtype), key=sds((2, s, 4, d), dtype), value=sds((2, s, 4, dv), dtype))


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_configs(d, dtype):
    for stage, cls in (("fwd", FwdParams), ("bwd", BwdParams)):
        h = heuristic_cfg(_inv(d, dtype=dtype), stage)
        assert isinstance(h, cls) and h.q_blocksize >= 16 and h.kv_blocksize >= 16
        cands = candidate_cfgs(_inv(d, dtype=dtype), stage)
        assert cands and cands[0] == h and len(set(cands)) == len(cands)
        assert all(isinstance(c, cls) for c in cands)
    assert heuristic_cfg(_inv(128), "fwd") == FwdParams(q_blocksize=128, kv_blocksize=64, num_warps=8, num_stages=3)
    # backward: (streamed, held) tiles, the held one the longer (interface._backward's tile rule)
    assert heuristic_cfg(_inv(128), "bwd") == BwdParams(q_blocksize=64, kv_blocksize=128, num_warps=8, num_stages=3)
    # a backward block tiles queries in one kernel and keys in the other: bounded by both lengths
    assert all(max(c.q_blocksize, c.kv_blocksize) <= 32 for c in candidate_cfgs(_inv(64, t=20), "bwd"))
    # short sequences get no 128-long blocks
    assert all(c.q_blocksize <= 32 for c in candidate_cfgs(_inv(64, t=20), "fwd"))


@pytest.mark.parametrize("extra", ["bias", "mask"])
def test_configs_count_bias_and_mask_tiles_in_shared_memory(extra):
    # The kernels buffer a bias/mask tile per stage beside K and V: float32 D128 with a float32 bias asked an H200
    # for 240 KiB of its 227 (GPU tier, gpu_bias_mqa) before the heuristic counted it.
    from ejkernel_triton.flash_attention.interface import _fits, _pow2, _smem_bwd, _smem_bytes, _smem_fwd

    inv = _inv(128, dtype=jnp.float32)
    t, s = 4096, 4096
    arr = {"bias": jax.ShapeDtypeStruct((2, 16, t, s), jnp.float32), "mask": jax.ShapeDtypeStruct((2, 1, t, s), bool)}
    with_extra = _Inv(**inv.arguments, **{"bias" if extra == "bias" else "attention_mask": arr[extra]})
    x = 4 if extra == "bias" else 1
    for stage, smem in (("fwd", _smem_fwd), ("bwd", _smem_bwd)):
        for c in candidate_cfgs(with_extra, stage):
            assert smem(c.q_blocksize, c.kv_blocksize, c.num_stages, 128, 128, 4, x) <= _smem_bytes()
            assert _fits(stage, c.q_blocksize, c.kv_blocksize, c.num_warps, c.num_stages, _pow2(128), 128, 4, x)
    if extra == "bias":  # the plain call's heuristic would not fit once the bias tiles count
        h = heuristic_cfg(inv, "fwd")
        assert _smem_fwd(h.q_blocksize, h.kv_blocksize, h.num_stages, 128, 128, 4, 4) > _smem_bytes()
        assert heuristic_cfg(with_extra, "fwd") != h


def test_supports():
    assert supports(_inv(128)) is None
    assert supports(_inv(192, 256)) is None
    assert "256" in supports(_inv(512))
    assert "float64" in supports(_inv(64, dtype=np.float64))


_COMPILE_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from ejkernel_triton import launch
    from ejkernel_triton.flash_attention import flash_attention
    assert not launch.INTERPRET

    def grads(*args, **kw):
        loss = lambda *a: flash_attention(*a, **kw).astype(jnp.float32).sum()
        jax.grad(loss, argnums=tuple(range(len(args))))(*args)

    z = lambda *shape, dt=jnp.bfloat16: jnp.zeros(shape, dt)
    # every flag on (bias + its gradient, soft cap, dropout, mask, segments, causal, GQA), bf16, GPU default blocks
    grads(z(2, 300, 4, 64), z(2, 300, 2, 64), z(2, 300, 2, 64), z(1, 4, 300, 300), causal=True,
          logits_soft_cap=20.0, dropout_prob=0.1, dropout_seed=7, attention_mask=jnp.ones((2, 1, 300, 300), bool),
          q_segment_ids=jnp.zeros((2, 300), jnp.int32), kv_segment_ids=jnp.zeros((2, 300), jnp.int32))
    # every flag off, fp16, padded head dims (80 -> 128, Dv 48 -> 64), varlen, window
    cu = jnp.array([0, 100, 250], jnp.int32)
    grads(z(1, 250, 2, 80, dt=jnp.float16), z(1, 250, 1, 80, dt=jnp.float16), z(1, 250, 1, 48, dt=jnp.float16),
          sliding_window=(32, 8), cu_seqlens_q=cu, cu_seqlens_k=cu)
    print("compiled")
""")


def test_kernels_compile_for_sm90():
    # The interpreter is not the compiler (e.g. it types a Python float scalar as float32 where
    # jax-triton passes float64). In a fresh process without interpreter mode, compile every kernel
    # variant two calls need for sm_90, typed as jax-triton types them, through Triton's bundled
    # ptxas, and check shared memory (launch.COMPILE_ONLY_ENV). float32 variants are left out:
    # their FMA dots take ~1 minute each to compile.
    env = {k: v for k, v in os.environ.items() if k not in ("EJKERNEL_TRITON_INTERPRET", "TRITON_INTERPRET")}
    env[launch.COMPILE_ONLY_ENV] = "90"
    run = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-4000:]


def test_bad_params(rng):
    q, k, v = _qkv(rng, 1, 8, 8, 1, 1, 16)
    with pytest.raises(ValueError, match="power of two"):
        flash_attention(q, k, v, fwd_params=FwdParams(q_blocksize=24))
    with pytest.raises(ValueError, match="must be 4-D"):
        flash_attention(q[0], k, v)
