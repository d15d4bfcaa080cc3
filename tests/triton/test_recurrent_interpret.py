"""ejkernel-triton's fused recurrent ``gla`` and ``gated_delta_rule`` (decoding) in Triton's interpreter.

The conformance suites check the contracts; this file checks what is particular to the fused recurrent kernel:
grouped value heads read in place (HV = 2 H), the value channels split over programs (``block_v``), the packed
layout with an empty sequence and tokens after the last, ``use_qk_l2norm``, bfloat16 inputs, the gradients of the
``custom_vjp`` (the reference's VJP), ``vmap`` folded into one launch, the registration above XLA on GPUs and
``supports`` declining long sequences; and ``lightning_attn``/``recurrent`` on gla's fused kernels.
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

from ejkernel.kernels import kernel_registry  # noqa: E402
from ejkernel.kernels.params import FwdParams  # noqa: E402
from ejkernel.testing import reference  # noqa: E402

from ejkernel_triton import gated_delta_rule as gdr_module  # noqa: E402
from ejkernel_triton import gla as gla_module  # noqa: E402
from ejkernel_triton._recurrent import RecurrentParams  # noqa: E402

B, H, HV, K, V = 2, 2, 4, 16, 32
SPLIT_V = RecurrentParams(block_v=16)  # two programs per (sequence, value head)


def _inputs(op, t, *, b=B, n=None, dtype=jnp.float32, seed=0):
    """The op's positional arrays and an initial state of ``n`` (default ``b``) sequences."""
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    q, k = normal(b, t, H, K), normal(b, t, H, K)
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = normal(b, t, HV, V)
    if op == "gla":
        gates = (0.25 * -np.logaddexp(0.0, -normal(b, t, HV, K)),)
    else:
        gates = (-np.logaddexp(0.0, -(normal(b, t, HV) + 4.0)), 1.0 / (1.0 + np.exp(-normal(b, t, HV))))
    arrays = tuple(jnp.asarray(x, dtype) for x in (q, k, v)) + tuple(jnp.asarray(x, jnp.float32) for x in gates)
    return arrays, jnp.asarray(0.5 * normal(n or b, HV, K, V))


def _impl(op):
    return {"gla": gla_module.gla, "gated_delta_rule": gdr_module.gated_delta_rule}[op]


def _ref(op):
    return {"gla": reference.gla, "gated_delta_rule": reference.gated_delta_rule}[op]


def _close(got, want, tol=2e-5):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, want, atol=tol * max(1.0, float(np.abs(want).max())), rtol=tol)


@pytest.mark.parametrize(
    ("op", "t", "options"),
    [
        ("gla", 1, {}),
        ("gla", 5, {"scale": 0.3}),
        ("gated_delta_rule", 1, {"use_qk_l2norm": True}),
        ("gated_delta_rule", 5, {}),
    ],
)
def test_states_in_and_out_match_reference(op, t, options):
    args, h0 = _inputs(op, t, seed=t)
    o, final = _impl(op)(*args, initial_state=h0, output_final_state=True, fwd_params=SPLIT_V, **options)
    want_o, want_final = _ref(op)(*args, initial_state=h0, output_final_state=True, **options)
    assert o.dtype == jnp.float32 and final.dtype == jnp.float32
    _close(o, want_o)
    _close(final, want_final)


@pytest.mark.parametrize("op", ["gla", "gated_delta_rule"])
def test_packed_sequences_with_an_empty_one(op):
    """Lengths 2, 0 and 3; tokens 5 and 6 are in no sequence (zeros); the empty one keeps its initial state."""
    cu = jnp.asarray([0, 2, 2, 5], jnp.int32)
    args, h0 = _inputs(op, 7, b=1, n=3, seed=11)
    extra = {"use_qk_l2norm": True} if op == "gated_delta_rule" else {}
    o, final = _impl(op)(*args, initial_state=h0, output_final_state=True, cu_seqlens=cu, fwd_params=SPLIT_V, **extra)
    want_o, want_final = _ref(op)(*args, initial_state=h0, output_final_state=True, cu_seqlens=cu, **extra)
    _close(o, want_o)
    _close(final, want_final)
    assert np.all(np.asarray(o[0, 5:]) == 0)
    np.testing.assert_array_equal(np.asarray(final[1]), np.asarray(h0[1]))


def test_bfloat16_inputs_float32_state():
    args, h0 = _inputs("gla", 5, dtype=jnp.bfloat16, seed=3)
    o, final = gla_module.gla(*args, initial_state=h0, output_final_state=True)
    want_o, want_final = reference.gla(*args, initial_state=h0, output_final_state=True)
    assert o.dtype == jnp.bfloat16 and final.dtype == jnp.float32
    _close(o, want_o, 2e-2)
    _close(final, want_final, 1e-4)  # float32 both sides, from the same bfloat16 inputs


@pytest.mark.parametrize("op", ["gla", "gated_delta_rule"])
def test_gradients_through_the_custom_vjp(op):
    args, h0 = _inputs(op, 3, seed=5)
    rng = np.random.default_rng(6)
    r_o = jnp.asarray(rng.standard_normal((B, 3, HV, V)), jnp.float32)
    r_s = jnp.asarray(rng.standard_normal((B, HV, K, V)), jnp.float32)

    def loss(fn):
        def f(*xs):
            o, final = fn(*xs[:-1], initial_state=xs[-1], output_final_state=True)
            return jnp.sum(o * r_o) + jnp.sum(final * r_s)

        return jax.jit(jax.grad(f, argnums=tuple(range(len(args) + 1))))

    got = loss(_impl(op))(*args, h0)
    want = loss(_ref(op))(*args, h0)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        _close(g, w, 1e-4)


def _one_head_inputs(t, *, b=B, n=None, seed=0):
    """``q``, ``k``, ``v`` with one head count (``lightning_attn``, ``recurrent``), the gates of both and a state."""
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    qkv = (normal(b, t, H, K), normal(b, t, H, K) / 4, normal(b, t, H, V))
    gates = {
        "slope": jnp.abs(normal(H)),
        "g": -jax.nn.softplus(-normal(b, t, H)),
        "g_k": 0.3 * -jax.nn.softplus(-normal(b, t, H, K)),
        "g_v": 0.3 * -jax.nn.softplus(-normal(b, t, H, V)),
    }
    return qkv, gates, 0.5 * normal(n or b, H, K, V)


_VALUE_GATED = [("recurrent", ("g_v",), False), ("recurrent", ("g", "g_k", "g_v"), True)]


# The chunked kernels (``ejkernel_triton.{op}.chunk``) take the same cases in the conformance suites (platform
# ``triton_chunk``: every gate combination, packed, reversed, with gradients); here only the fused ones.
@pytest.mark.parametrize(
    ("op", "gates", "reverse"),
    [("lightning_attn", ("slope",), False), ("recurrent", ("g",), False), ("recurrent", ("g_k",), True),
     ("recurrent", ("g", "g_k"), False), ("recurrent", (), True), *_VALUE_GATED],
)  # fmt: skip
def test_lightning_and_recurrent_fold_their_gates_into_gla(op, gates, reverse):
    """``lightning_attn`` and ``recurrent`` on gla's fused recurrent kernel: outputs, final state, packed sequences
    (lengths 2, 0, 3; two tokens in none), ``reverse`` (the flipped sequence) and the gradients of every input, the
    gates included."""
    import importlib

    impl = getattr(importlib.import_module(f"ejkernel_triton.{op}.interface"), op)
    ref = {"lightning_attn": reference.lightning_attn, "recurrent": reference.recurrent}[op]
    cu = jnp.asarray([0, 2, 2, 5], jnp.int32)
    rev = {"reverse": True} if reverse else {}
    for kw, (qkv, all_gates, h0) in (
        ({**rev}, _one_head_inputs(3, seed=1)),
        ({"cu_seqlens": cu, **rev}, _one_head_inputs(7, b=1, n=3, seed=2)),
    ):
        named = {name: all_gates[name] for name in gates}
        diff = (*qkv, h0, *named.values())

        def loss(fn, *xs, kw=kw, names=tuple(named)):
            o, final = fn(*xs[:3], initial_state=xs[3], output_final_state=True, **dict(zip(names, xs[4:])), **kw)
            return jnp.sum(o * jnp.cos(o)) + jnp.sum(final**2), (o, final)

        (_, got_out), got = jax.value_and_grad(
            lambda *xs: loss(impl, *xs), argnums=tuple(range(len(diff))), has_aux=True
        )(*diff)
        (_, want_out), want = jax.value_and_grad(
            lambda *xs: loss(ref, *xs), argnums=tuple(range(len(diff))), has_aux=True
        )(*diff)
        for g, w in zip((*got_out, *got), (*want_out, *want), strict=True):
            _close(g, w, 1e-4)


@pytest.mark.parametrize(("op", "gates", "gate_k"), [("lightning_attn", ("slope",), False),
    ("recurrent", ("g", "g_v"), False), ("recurrent", ("g", "g_k"), True)])  # fmt: skip
def test_decode_reads_one_decay_per_head_without_a_key_gate(monkeypatch, op, gates, gate_k):
    """Without a key gate the fused recurrent kernel reads ``[B, T, H]`` decays (``GATE_K`` off), not a ``[B, T, H,
    K]`` broadcast that XLA would write first."""
    import importlib

    from ejkernel_triton import _recurrent

    seen = []
    launch = _recurrent._launch
    monkeypatch.setattr(_recurrent, "_launch", lambda s, *a: seen.append(a[6].ndim) or launch(s, *a))
    (q, k, v), all_gates, _ = _one_head_inputs(2)
    impl = getattr(importlib.import_module(f"ejkernel_triton.{op}.interface"), op)
    o, _ = impl(q, k, v, **{name: all_gates[name] for name in gates})
    ref, _ = getattr(reference, op)(q, k, v, **{name: all_gates[name] for name in gates})
    _close(o, ref, 1e-5)
    assert seen == [4 if gate_k else 3], seen


def test_chunked_recurrent_declines_value_gates():
    """The chunked kernels decay the key side only: they decline ``g_v`` (the fused recurrent kernel takes it)."""
    from ejkernel.ops import Invocation

    from ejkernel_triton.recurrent import chunk as module
    from ejkernel_triton.recurrent import interface

    sds = jax.ShapeDtypeStruct
    base = {
        "q": sds((1, 2, H, K), jnp.float32),
        "k": sds((1, 2, H, K), jnp.float32),
        "v": sds((1, 2, H, V), jnp.float32),
    }
    supports = lambda **kw: module.supports(Invocation.create("recurrent", {**base, **kw}, "cpu"))  # noqa: E731
    assert supports(g=sds((1, 2, H), jnp.float32), reverse=True) is None
    assert "g_v" in supports(g_v=sds((1, 2, H, V), jnp.float32))
    inv = Invocation.create("recurrent", {**base, "g_v": sds((1, 2, H, V), jnp.float32)}, "cpu")
    assert interface.supports(inv) is None
    assert "g_v dtype int32" in interface.supports(
        Invocation.create("recurrent", {**base, "g_v": sds((1, 2, H, V), jnp.int32)}, "cpu")
    )
    assert "g_k dtype int32 is not supported" in supports(g_k=sds((1, 2, H, K), jnp.int32))
    (q, k, v), _, _ = _one_head_inputs(2)
    with pytest.raises(ValueError, match="g_v"):
        module.recurrent(q, k, v, g_v=jnp.zeros_like(v))


def test_vmap_folds_into_one_launch(monkeypatch):
    from ejkernel_triton import _recurrent

    batches = []
    launch = _recurrent._launch
    monkeypatch.setattr(_recurrent, "_launch", lambda s, *a: batches.append(a[3].shape[0]) or launch(s, *a))
    args, h0 = _inputs("gated_delta_rule", 2, seed=8)

    def f(*xs):
        return gdr_module.gated_delta_rule(*xs[:-1], initial_state=xs[-1], output_final_state=True)

    eager = f(*args, h0)
    mapped = jax.vmap(f)(*(x[:, None] for x in (*args, h0)))
    for got, want in zip(mapped, eager, strict=True):
        _close(got[:, 0], want, 1e-6)
    # the vmapped call launches once for its B elements of one row each (unfolded, it would launch per element)
    assert batches[-1] == B, batches


def test_supports_declines_long_sequences_and_wide_heads():
    from ejkernel.ops import Invocation

    def inv(t, k=K, cu=None):
        args = {
            "q": jax.ShapeDtypeStruct((1, t, H, k), jnp.float32),
            "k": jax.ShapeDtypeStruct((1, t, H, k), jnp.float32),
            "v": jax.ShapeDtypeStruct((1, t, HV, V), jnp.float32),
            "g": jax.ShapeDtypeStruct((1, t, HV), jnp.float32),
            "beta": jax.ShapeDtypeStruct((1, t, HV), jnp.float32),
            "cu_seqlens": None if cu is None else jax.ShapeDtypeStruct((cu + 1,), jnp.int32),
        }
        return Invocation.create("gated_delta_rule", args, "cpu")

    assert gdr_module.supports(inv(1)) is None
    assert gdr_module.supports(inv(32)) is None
    assert "T=37 > 32" in gdr_module.supports(inv(37))  # the conformance suites' CPU-tier length: declined
    assert gdr_module.supports(inv(100, cu=4)) is None  # four packed sequences of 25 tokens on average
    assert "mean length > 32" in gdr_module.supports(inv(300, cu=4))
    assert "head dims" in gdr_module.supports(inv(1, k=512))


def test_chunked_lightning_and_recurrent_leave_decode_steps_to_xla_on_gpus(monkeypatch):
    """On a GPU the chunked ``lightning_attn`` and ``recurrent`` (above XLA for training shapes) decline decode
    steps, which XLA serves faster; the interpreter takes any length."""
    from ejkernel.ops import Invocation

    from ejkernel_triton import _recurrent
    from ejkernel_triton.lightning_attn import chunk as lightning_chunk
    from ejkernel_triton.recurrent import chunk as recurrent_chunk

    def inv(op, t, cu=None):
        s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731
        args = {"q": s(1, t, H, K), "k": s(1, t, H, K), "v": s(1, t, H, V), "cu_seqlens": None}
        args |= {"slope": jax.ShapeDtypeStruct((H,), jnp.float32)} if op == "lightning_attn" else {"g": s(1, t, H)}
        if cu is not None:
            args["cu_seqlens"] = jax.ShapeDtypeStruct((cu + 1,), jnp.int32)
        return Invocation.create(op, args, "cpu")

    for op, module in (("lightning_attn", lightning_chunk), ("recurrent", recurrent_chunk)):
        assert module.supports(inv(op, 1)) is None  # interpreted
        monkeypatch.setattr(_recurrent, "interpreting", lambda: False)
        assert f"{op} (chunked): decode steps" in module.supports(inv(op, 1))
        assert f"{op} (chunked): decode steps" in module.supports(inv(op, 100, cu=4))  # 25 tokens on average
        assert module.supports(inv(op, 33)) is None and module.supports(inv(op, 300, cu=4)) is None
        monkeypatch.undo()


def test_params_and_registration_above_xla_on_gpus():
    with pytest.raises(ValueError, match="RecurrentParams.block_v must be a power of two"):
        RecurrentParams(block_v=24)
    assert RecurrentParams.from_generic(FwdParams(num_warps=2)) == RecurrentParams(num_warps=2)
    with pytest.raises(ValueError, match="q_blocksize"):
        RecurrentParams.from_generic(FwdParams(q_blocksize=16))
    for op in ("gla", "gated_delta_rule", "lightning_attn", "recurrent"):
        gpu = {i.name: i.priority for i in kernel_registry.implementations(op, backend="gpu")}
        if "xla" in gpu and op in ("gla", "gated_delta_rule"):
            assert gpu["triton"] > gpu["xla"], gpu  # checked and timed on an H200: decode steps go to it
        elif "xla" in gpu:
            assert gpu["triton"] < gpu["xla"], gpu  # slower than XLA on an H200 (lightning decode): not the default
        cpu = {i.name: i.priority for i in kernel_registry.implementations(op, backend="cpu")}
        assert cpu["triton_interpret"] == 1
