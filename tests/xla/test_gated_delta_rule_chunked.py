"""The XLA gated delta rule: every chunk size (1 is the recurrence) against the reference, the packed layout
with many short sequences, the backward with its own chunk size, and the triangular inverse.

Inputs are fresh each run; set ``EJKERNEL_TEST_SEED`` to the seed a failure names.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.ops import Invocation
from ejkernel.testing.reference import gated_delta_rule as reference

from ejkernel_xla.gated_delta_rule import candidate_cfgs, gated_delta_rule, heuristic_cfg
from ejkernel_xla.gated_delta_rule._chunked import unit_lower_inverse
from ejkernel_xla.params import DeltaRuleParams

SEED = int(os.environ.get("EJKERNEL_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
# lengths 1, 0, 4, 12, 1, 29, 2; T = 52 leaves 3 tokens outside every sequence
CU = (0, 1, 1, 5, 17, 18, 47, 49)


def _inputs(b: int, t: int, n: int, seed: int) -> tuple[tuple[jax.Array, ...], jax.Array]:
    ks = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(ks[0], (b, t, 2, 8))
    k = jax.random.normal(ks[1], (b, t, 2, 8))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(ks[2], (b, t, 2, 5))
    g = jax.nn.log_sigmoid(jax.random.normal(ks[3], (b, t, 2)) + 3.0)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, 2)))
    return (q, k, v, g, beta), jax.random.normal(ks[5], (n, 2, 8, 5))


def _rel(got: jax.Array, want: jax.Array) -> float:
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


@functools.cache
def _packed_case() -> tuple[tuple[jax.Array, ...], dict, tuple[jax.Array, jax.Array]]:
    args, s0 = _inputs(1, 52, len(CU) - 1, SEED)
    kw = {"initial_state": s0, "output_final_state": True, "cu_seqlens": jnp.array(CU)}
    return args, kw, jax.jit(lambda *a: reference(*a, **kw))(*args)


@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_chunk_sizes_agree_with_the_recurrence_on_many_short_sequences(chunk):
    args, kw, (want_o, want_s) = _packed_case()
    o, s = jax.jit(lambda *a: gated_delta_rule(*a, **kw, fwd_params=DeltaRuleParams(chunk_size=chunk)))(*args)
    assert _rel(o, want_o) < 1e-5, f"chunk {chunk}: output (seed {SEED})"
    assert _rel(s, want_s) < 1e-5, f"chunk {chunk}: final states (seed {SEED})"
    assert np.all(np.asarray(o[0, 49:]) == 0)


def test_backward_with_its_own_chunk_size():
    args, s0 = _inputs(2, 40, 2, SEED)

    def loss(fn, *a, **kw):
        o, s = fn(*a[:5], initial_state=a[5], output_final_state=True, use_qk_l2norm=True, **kw)
        return jnp.sum(o * jnp.cos(o)) + jnp.sum(s * s)

    params = {"fwd_params": DeltaRuleParams(chunk_size=16), "bwd_params": DeltaRuleParams(chunk_size=5)}
    got = jax.jit(jax.grad(lambda *a: loss(gated_delta_rule, *a, **params), argnums=range(6)))(*args, s0)
    want = jax.jit(jax.grad(lambda *a: loss(reference, *a), argnums=range(6)))(*args, s0)
    for name, g, w in zip(("dq", "dk", "dv", "dg", "dbeta", "dinitial_state"), got, want):
        assert _rel(g, w) < 1e-4, f"{name} (seed {SEED})"


@pytest.mark.parametrize("c", [5, 16, 40])
def test_unit_lower_inverse_and_its_gradient(c):
    a = jnp.tril(0.3 * jax.random.normal(jax.random.key(SEED), (3, c, c)), -1)
    cot = jax.random.normal(jax.random.key(SEED + 1), (3, c, c))
    got, vjp = jax.vjp(unit_lower_inverse, a)
    want, want_vjp = jax.vjp(lambda a: jnp.linalg.inv(jnp.eye(c) + jnp.tril(a, -1)), a)
    assert _rel(got, want) < 1e-5
    assert _rel(vjp(cot)[0], want_vjp(cot)[0]) < 1e-4


def test_heuristic_chunk_follows_the_mean_sequence_length():
    def inv(t: int, n: int | None = None) -> Invocation:
        args = {"q": jnp.zeros((1, t, 2, 8))}
        if n is not None:
            args["cu_seqlens"] = jnp.zeros((n + 1,), jnp.int32)
        return Invocation.create("gated_delta_rule", args, "cpu")

    assert heuristic_cfg(inv(1), "fwd") == DeltaRuleParams(chunk_size=1)  # decoding: the recurrence
    assert heuristic_cfg(inv(40), "bwd") == DeltaRuleParams(chunk_size=64)
    assert heuristic_cfg(inv(4096), "fwd") == DeltaRuleParams(chunk_size=64)
    assert heuristic_cfg(inv(4096, n=256), "fwd") == DeltaRuleParams(chunk_size=16)  # mean length 16
    chunks = [p.chunk_size for p in candidate_cfgs(inv(4096), "fwd")]
    assert chunks[0] == 64 and set(chunks) == {16, 32, 64, 128}
    assert 1 in [p.chunk_size for p in candidate_cfgs(inv(30), "fwd")]
