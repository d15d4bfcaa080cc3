"""Forward-mode differentiation (``jax.jvp``, ``jacfwd``, ``linearize``, ``hessian``) of the ops, and reverse mode
still running the implementation's own backward."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejkernel.modules import FlashAttentionConfig
from ejkernel.modules.operations import attention, flash_attention, gla, grouped_matmul, mean_pooling
from ejkernel.testing import reference

from ._plugins import BWD_CANDIDATES, FWD_CANDIDATES, calls, costly_attention


def _normal(seed, *shapes, dtype=jnp.float32):
    return tuple(
        jax.random.normal(k, s, jnp.float32).astype(dtype)
        for k, s in zip(jax.random.split(jax.random.key(seed), len(shapes)), shapes)
    )


def _gla_log_gates(seed, shape):
    return -jax.nn.softplus(jax.random.normal(jax.random.key(seed), shape))


# (op, differentiated arrays, the rest of the call), built when a test asks: tiny shapes, so that jacfwd/jacrev
# stay cheap on CPU.
CASES = {
    "flash_attention": lambda: (
        flash_attention,
        _normal(0, (1, 6, 2, 4), (1, 5, 2, 4), (1, 5, 2, 4)),
        {"causal": True},
    ),
    "attention": lambda: (attention, _normal(1, (1, 5, 2, 4), (1, 5, 1, 4), (1, 5, 1, 4), (1, 2, 5, 5)), {}),
    "gla": lambda: (
        gla,
        (*_normal(2, (1, 6, 2, 4), (1, 6, 2, 4), (1, 6, 2, 3)), _gla_log_gates(3, (1, 6, 2, 4))),
        {"output_final_state": True},
    ),
    "grouped_matmul": lambda: (
        grouped_matmul,
        _normal(4, (7, 3), (3, 3, 4)),
        {"group_sizes": jnp.asarray([2, 0, 4], jnp.int32)},
    ),
    "mean_pooling": lambda: (mean_pooling, _normal(5, (1, 7, 3)), {"cu_seqlens": jnp.asarray([0, 2, 6], jnp.int32)}),
}


def _fns(name):
    fn, arrays, rest = CASES[name]()
    ref = getattr(reference, name)

    def bind(f):
        # grouped_matmul's group_sizes is positional (after the differentiated arrays); the rest are keywords.
        if name == "grouped_matmul":
            return lambda *xs: f(*xs, rest["group_sizes"])
        return lambda *xs: f(*xs, **rest)

    return bind(fn), bind(ref), arrays


def _tangents(arrays, seed=9):
    return _normal(seed, *(x.shape for x in arrays), dtype=arrays[0].dtype)


def _close(got, want, tol=2e-5, what=""):
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want), what
    for g, w in zip(got, want):
        np.testing.assert_allclose(
            np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol, atol=tol, err_msg=what
        )


@pytest.mark.parametrize("name", CASES)
def test_jvp_wiring_matches_the_reference(name):
    """The primal comes from the implementation; every tangent is the reference's own JVP (the core's forward-mode
    rule), so the tangents check the wiring (jit, symbolic zeros, dtypes); the test below checks that rule against
    the implementation's own backward (jacfwd against jacrev)."""
    f, ref, arrays = _fns(name)
    t = _tangents(arrays)
    out, tan = jax.jvp(f, arrays, t)
    ref_out, ref_tan = jax.jvp(ref, arrays, t)
    _close(out, ref_out)
    _close(tan, ref_tan)
    assert [x.dtype for x in jax.tree.leaves(tan)] == [x.dtype for x in jax.tree.leaves(out)]
    # Under jit too, and one input at a time (the others' tangents are symbolic zeros).
    _close(jax.jit(lambda *a: jax.jvp(f, a, t))(*arrays)[1], ref_tan)
    only_first = jax.jit(lambda x: jax.jvp(lambda x: f(x, *arrays[1:]), (x,), t[:1])[1])(arrays[0])
    _close(only_first, jax.jvp(lambda x: ref(x, *arrays[1:]), arrays[:1], t[:1])[1])


@pytest.mark.parametrize("name", CASES)
def test_linearize_and_jacfwd_agree_with_reverse_mode(name):
    f, _, arrays = _fns(name)
    t = _tangents(arrays)
    _, lin = jax.linearize(f, *arrays)
    _close(lin(*t), jax.jvp(f, arrays, t)[1])
    # The forward tangent and the kernel's VJP are transposes of one another: jacfwd == jacrev.
    _close(jax.jit(jax.jacfwd(f))(*arrays), jax.jit(jax.jacrev(f))(*arrays), tol=1e-4)


def test_second_order_and_vmap_compose():
    # Second order differentiates the kernel's own backward: plain JAX in the XLA kernels, but an opaque
    # launch (a callback in the interpreter) in Triton's and Pallas's, which JAX cannot differentiate again.
    from ejkernel.kernels import kernel_registry

    if not kernel_registry.implementations("flash_attention", platform="xla"):
        pytest.skip("second order needs a backward written in JAX (the ejkernel-xla plugin)")
    f, ref, arrays = _fns("flash_attention")
    q, k, v = arrays
    t = _tangents((q,))
    qs = jnp.stack([q, 2 * q])
    transforms = {  # compiled: op by op the blockwise kernels are slow on CPU
        "hessian": lambda loss: jax.hessian(loss)(q),
        "jvp of grad": lambda loss: jax.jvp(jax.grad(loss), (q,), t)[1],
        "vmap of grad": lambda loss: jax.vmap(jax.grad(loss))(qs),
        "grad of vmap": lambda loss: jax.grad(lambda qs: jax.vmap(loss)(qs).sum())(qs),
        "vmap of jacfwd": lambda loss: jax.vmap(jax.jacfwd(loss))(qs),
    }

    def loss(fn):
        return lambda q: jnp.sum(jnp.sin(fn(q, k, v)))

    for what, transform in transforms.items():
        got, want = (jax.jit(functools.partial(transform, loss(fn)))() for fn in (f, ref))
        _close(got, want, tol=1e-4, what=what)


def test_half_precision_tangent_has_the_output_dtype():
    f, ref, arrays = _fns("flash_attention")
    arrays = tuple(x.astype(jnp.bfloat16) for x in arrays)
    t = _tangents(arrays)
    out, tan = jax.jvp(f, arrays, t)
    assert out.dtype == tan.dtype == jnp.bfloat16
    _close(tan, jax.jvp(ref, arrays, t)[1], tol=3e-2)


def test_reverse_mode_runs_the_implementations_backward_and_forward_mode_the_reference(costly_plugin):
    # The in-test "costly" kernel computes its own function with its own backward: gradients must be that
    # backward's (with the chosen launch parameters), not the reference's transposed.
    q, k, v = _normal(7, (1, 4, 2, 8), (1, 4, 2, 8), (1, 4, 2, 8))
    cfg = FlashAttentionConfig(platform="costly", fwd_params=FWD_CANDIDATES[1], bwd_params=BWD_CANDIDATES[1])

    def f(q):
        return flash_attention(q, k, v, cfg=cfg)

    def own(q):
        return costly_attention(q, k, v, fwd_params=FWD_CANDIDATES[1], bwd_params=BWD_CANDIDATES[1])

    ct = _tangents((q,), seed=3)[0]
    _close(jax.vjp(f, q)[1](ct), jax.vjp(own, q)[1](ct))
    _close(jax.jit(jax.grad(lambda q: jnp.vdot(ct, f(q))))(q), jax.grad(lambda q: jnp.vdot(ct, own(q)))(q))
    assert calls[-1] == (FWD_CANDIDATES[1], BWD_CANDIDATES[1])
    out, tan = jax.jvp(f, (q,), (ct,))
    _close(out, own(q))
    _close(tan, jax.jvp(lambda q: reference.flash_attention(q, k, v), (q,), (ct,))[1])
