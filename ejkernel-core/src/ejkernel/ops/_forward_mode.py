"""Forward-mode differentiation of executor calls, without giving up the kernels' own backward.

A differentiated call's tangent is ``J(p) t``. ``jax.custom_vjp`` cannot be pushed forward, and a
``jax.custom_jvp`` rule written in plain JAX is reverse-differentiated by transposing that code. So the
tangent is one primitive, ``ejkernel_tangent``, with both directions given: evaluated (jvp, jacfwd,
linearize) it is ``jax.jvp`` of the op's tangent function (``Kernel.tangent``: the float32 reference by
default); transposed (grad, vjp, jacrev) it is the selected implementation's own VJP. Reverse mode
therefore runs the same kernels as a ``jax.custom_vjp`` would. Its residuals also hold the call's array
arguments (``jax.linearize`` needs them to evaluate the tangent later); a compiled gradient drops them
again where the backward does not read them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

tangent_p = Primitive("ejkernel_tangent")
tangent_p.multiple_results = True


@dataclasses.dataclass(frozen=True, eq=False)
class _Linear:
    """``t -> J(p) t`` (``fwd(p, t)``) and its transpose ``ct -> J(p)^T ct`` (``bwd(r, ct)``) on flat lists.

    ``p`` are the call's array arguments, ``r`` the residuals of its VJP, ``t`` the nonzero tangents.
    """

    num_p: int
    num_r: int
    fwd: Callable[[Sequence[Any], Sequence[Any]], list[Any]]
    bwd: Callable[[Sequence[Any], Sequence[Any]], list[Any]]

    def split(self, operands: Sequence[Any]) -> tuple[list[Any], list[Any], list[Any]]:
        p, r = self.num_p, self.num_p + self.num_r
        return list(operands[:p]), list(operands[p:r]), list(operands[r:])


def _bind(lin: _Linear, p: Sequence[Any], r: Sequence[Any], t: Sequence[Any], out_avals: tuple[Any, ...]) -> Any:
    return tangent_p.bind(*p, *r, *t, lin=lin, out_avals=out_avals)


def _impl(*operands: Any, lin: _Linear, out_avals: tuple[Any, ...]) -> list[Any]:
    p, _, t = lin.split(operands)
    return lin.fwd(p, t)


def _jvp(primals: Sequence[Any], tangents: Sequence[Any], *, lin: _Linear, out_avals: tuple[Any, ...]) -> Any:
    # Linear in t; in p through fwd (the residuals are functions of p, used only by the transpose).
    p, r, t = lin.split(primals)
    dp, _, dt = lin.split(tangents)
    out = _bind(lin, p, r, t, out_avals)
    terms = []
    if any(type(x) is not ad.Zero for x in dt):
        terms.append(_bind(lin, p, r, [ad.instantiate_zeros(x) for x in dt], out_avals))
    if any(type(x) is not ad.Zero for x in dp):
        dp = [ad.instantiate_zeros(x) for x in dp]
        terms.append(jax.jvp(lambda *p: lin.fwd(list(p), t), p, dp)[1])
    if not terms:
        return out, [ad.Zero(a) for a in out_avals]
    return out, [sum(ts[1:], ts[0]) for ts in zip(*terms)]


def _transpose(cts: Sequence[Any], *operands: Any, lin: _Linear, out_avals: tuple[Any, ...]) -> list[Any]:
    p, r, t = lin.split(operands)
    assert not any(ad.is_undefined_primal(x) for x in (*p, *r)), "ejkernel_tangent is linear in its tangents only"
    cts_t = lin.bwd(r, [ad.instantiate_zeros(ct) for ct in cts])
    return [None] * (lin.num_p + lin.num_r) + [c if ad.is_undefined_primal(x) else None for x, c in zip(t, cts_t)]


def _batch(operands: Sequence[Any], dims: Sequence[Any], *, lin: _Linear, out_avals: tuple[Any, ...]) -> Any:
    # The batched call stays one primitive, so that it still transposes to the (vmapped) kernel VJP.
    size = next(x.shape[d] for x, d in zip(operands, dims) if d is not None)
    front = [x if d is None else jnp.moveaxis(x, d, 0) for x, d in zip(operands, dims)]
    axes = [None if d is None else 0 for d in dims]
    p, r, t = lin.split(front)
    p_axes, r_axes, t_axes = lin.split(axes)
    t = [x if a == 0 else jnp.broadcast_to(x, (size, *x.shape)) for x, a in zip(t, t_axes)]
    batched = _Linear(
        lin.num_p,
        lin.num_r,
        fwd=jax.vmap(lin.fwd, in_axes=(p_axes, 0)),
        bwd=jax.vmap(lin.bwd, in_axes=(r_axes, 0)),
    )
    avals = tuple(a.update(shape=(size, *a.shape)) for a in out_avals)
    return _bind(batched, p, r, t, avals), [0] * len(out_avals)


tangent_p.def_impl(_impl)
tangent_p.def_abstract_eval(lambda *_, lin, out_avals: list(out_avals))
ad.primitive_jvps[tangent_p] = _jvp
ad.primitive_transposes[tangent_p] = _transpose
batching.primitive_batchers[tangent_p] = _batch
mlir.register_lowering(tangent_p, mlir.lower_fun(_impl, multiple_results=True))


def _differentiable(x: Any) -> bool:
    return bool(jnp.issubdtype(x.dtype, jnp.inexact))


def call_tangent(
    tangent_fn: Callable[[dict[str, Any], dict[str, Any]], Any],
    primals: Mapping[str, Any],
    tangents: Mapping[str, Any],
    out: Any,
    vjp: Any,
) -> Any:
    """The tangent of ``out`` along ``tangents`` (``SymbolicZero`` where zero), transposing to ``vjp``.

    ``tangent_fn(primals, nonzero_tangents)`` is the tangent in forward mode; ``vjp`` (from ``jax.vjp``
    of the call at ``primals``) gives the cotangents of ``primals`` in reverse mode.
    """
    names = list(primals)
    moving = [k for k in names if not isinstance(tangents[k], SymbolicZero)]
    outs, out_tree = jax.tree.flatten(out)
    res, res_tree = jax.tree.flatten(vjp)
    kept = [i for i, o in enumerate(outs) if _differentiable(o)]

    def fwd(p: Sequence[Any], t: Sequence[Any]) -> list[Any]:
        got = jax.tree.leaves(tangent_fn(dict(zip(names, p)), dict(zip(moving, t))))
        return [jnp.asarray(got[i], outs[i].dtype) for i in kept]

    def bwd(r: Sequence[Any], ct: Sequence[Any]) -> list[Any]:
        full: list[Any] = [np.zeros(o.shape, jax.dtypes.float0) for o in outs]
        for i, c in zip(kept, ct):
            full[i] = c
        (grads,) = jax.tree.unflatten(res_tree, r)(jax.tree.unflatten(out_tree, full))
        return [grads[k] for k in moving]

    lin = _Linear(len(names), len(res), fwd, bwd)
    avals = tuple(jax.typeof(outs[i]).to_tangent_aval() for i in kept)
    got = iter(_bind(lin, [primals[k] for k in names], res, [tangents[k] for k in moving], avals))
    return jax.tree.unflatten(
        out_tree, [next(got) if i in kept else np.zeros(o.shape, jax.dtypes.float0) for i, o in enumerate(outs)]
    )
