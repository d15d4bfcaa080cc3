"""Triton ``gated_delta_rule`` for training shapes: the chunked forward of ``ejkernel_triton._delta_chunk_kernels``
(the WY representation, three launches).

Tokens are cut into chunks of ``chunk_size`` (every packed sequence starts a new chunk; the chunk table is
``ejkernel_triton.gla.chunk``'s, computed on the device, so the call works under ``jit``). ``use_qk_l2norm``
normalizes ``q`` and ``k`` in float32 before the launches. Grouped value heads read their query/key head in the
kernels. Every product is a float32 dot (three tf32 passes on a GPU); states are float32.

Gradients: ``jax.custom_vjp`` whose backward is the VJP of the core's reference recurrence, as for the fused
recurrent kernel (``ejkernel_triton._recurrent``: ``T * (B or N) * HV * K * V`` float32 of memory); a chunked
backward kernel is still to come. Launch parameters: :class:`~ejkernel_triton.gla.chunk.ChunkFwdParams`
(``chunk_size``, ``block_v``, warps, stages; ``block_k`` is the whole padded head dim here) and
:class:`~ejkernel_triton._recurrent.NoBwdParams`. Declined (``supports``): head dims above 256, dtypes other
than float32, bfloat16 and float16.

Importing this module does not import Triton.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.device import cdiv, fold_vmap
from ejkernel.kernels.params import coerce

from ejkernel_triton._decode import interpreting
from ejkernel_triton._recurrent import NoBwdParams, reference_vjp
from ejkernel_triton.gla import chunk as gla_chunk
from ejkernel_triton.gla.chunk import ChunkFwdParams, _chunk_table, _pow2, _rows

__all__ = ["candidate_cfgs", "gated_delta_rule", "heuristic_cfg", "supports"]

OP = "gated_delta_rule"
_DUMMY_F32 = np.zeros((1,), np.float32)


@dataclasses.dataclass(frozen=True)
class Plan:
    chunk: int
    block_v: int
    num_warps: int
    num_stages: int


def _plan(dk: int, dv: int, p: ChunkFwdParams) -> Plan:
    """``p``'s fields, else the heuristic's: chunks of 64 (16 in the interpreter), value blocks of 64 channels
    (all of them in the interpreter), 4 warps, 2 stages. ``block_k``: the kernels take the whole padded key dim,
    so any other value is refused rather than ignored."""
    if p.block_k is not None and p.block_k != _pow2(dk):
        raise ValueError(
            f"ejkernel-triton {OP} (chunked): ChunkFwdParams.block_k must be None or {_pow2(dk)} (the whole padded "
            f"key dim K={dk}), got {p.block_k}"
        )
    bv = _pow2(dv) if interpreting() else min(64, _pow2(dv))
    return Plan(
        p.chunk_size or (16 if interpreting() else 64),
        min(p.block_v or bv, _pow2(dv)),
        p.num_warps or 4,
        p.num_stages or (1 if interpreting() else 2),
    )


def _params(plan: Plan) -> ChunkFwdParams:
    return ChunkFwdParams(
        chunk_size=plan.chunk, block_v=plan.block_v, num_warps=plan.num_warps, num_stages=plan.num_stages
    )


def heuristic_cfg(inv: Any, stage: str = "fwd") -> ChunkFwdParams | NoBwdParams:
    if stage != "fwd":
        return NoBwdParams()  # the backward is the reference's VJP: nothing to tune
    args = gla_chunk._arguments(inv)
    return _params(_plan(int(args["q"].shape[-1]), int(args["v"].shape[-1]), ChunkFwdParams()))


def candidate_cfgs(inv: Any, stage: str = "fwd") -> list[ChunkFwdParams] | list[NoBwdParams]:
    """The heuristic's first; chunks of 32 and value blocks of 32, 4 or 8 warps."""
    if stage != "fwd":
        return [NoBwdParams()]
    base = heuristic_cfg(inv, "fwd")
    assert isinstance(base, ChunkFwdParams)
    out = [base]
    for chunk, bv, warps in ((64, 32, 4), (32, 64, 4), (64, 64, 8), (32, 32, 4)):
        p = dataclasses.replace(base, chunk_size=chunk, block_v=min(bv, base.block_v or bv), num_warps=warps)
        if p not in out:
            out.append(p)
    return out


def supports(inv: Any) -> str | None:
    """The chunked ``gla``'s rules (dtypes, head dims up to 256), for ``q``, ``g``, ``beta``, ``initial_state``."""
    reason = gla_chunk.supports(inv)
    beta = gla_chunk._arguments(inv).get("beta")
    if reason is None and beta is not None and np.dtype(beta.dtype).name not in ("float32", "bfloat16", "float16"):
        reason = f"ejkernel-triton {OP} (chunked): beta dtype {np.dtype(beta.dtype).name} is not supported"
    return reason


@dataclasses.dataclass(frozen=True)
class Static:
    plan: Plan
    scale: float
    output_final_state: bool
    use_qk_l2norm: bool
    delta: bool = True  # for ``_recurrent.reference_vjp``, the backward


def _prec() -> str:
    return "ieee" if interpreting() else "tf32x3"


def _forward_rows(s: Static, tab: Any, q, k, v, g, beta, h0):  # noqa: ANN001, ANN202
    """``(o [R, HV, V], final state [N, HV, K, V])`` of token rows laid out by ``tab``, float32."""
    from ejkernel_triton import _delta_chunk_kernels as kern
    from ejkernel_triton import launch

    plan = s.plan
    r, h, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    bk, f32 = _pow2(dk), jnp.float32
    sizes: dict[str, Any] = {"H": h, "HV": hv, "DK": dk, "DV": dv, "BT": plan.chunk, "BK": bk, "PREC": _prec()}
    common: dict[str, Any] = {"num_warps": plan.num_warps, "num_stages": plan.num_stages}
    w, u, b = launch.launch(
        kern.delta_prep,
        k,
        v,
        g,
        beta,
        tab.cu,
        tab.seq,
        tab.off,
        out_shape=(
            jax.ShapeDtypeStruct((r, hv, dk), f32),
            jax.ShapeDtypeStruct((r, hv, dv), f32),
            jax.ShapeDtypeStruct((r, hv), f32),
        ),
        grid=(tab.nt, hv),
        name="ejkernel_gdr_chunk_prep",
        BV=plan.block_v,
        **sizes,
        **common,
    )
    uc, hs, ht = launch.launch(
        kern.delta_states,
        k,
        w,
        u,
        b,
        jnp.asarray(_DUMMY_F32) if h0 is None else h0,
        tab.cu,
        tab.off,
        out_shape=(
            jax.ShapeDtypeStruct((r, hv, dv), f32),
            jax.ShapeDtypeStruct((tab.nt, hv, dk, dv), f32),
            jax.ShapeDtypeStruct((tab.n, hv, dk, dv), f32),
        ),
        grid=(tab.n * cdiv(dv, plan.block_v), hv),
        name="ejkernel_gdr_chunk_states",
        BV=plan.block_v,
        HAS_H0=h0 is not None,
        **sizes,
        **common,
    )
    (o,) = launch.launch(
        kern.delta_output,
        q,
        k,
        b,
        hs,
        uc,
        tab.cu,
        tab.seq,
        tab.off,
        float(s.scale),
        out_shape=(jax.ShapeDtypeStruct((r, hv, dv), f32),),
        grid=(tab.nt * cdiv(dv, plan.block_v), hv),
        zeroed_outputs=(0,),  # tokens outside every sequence give zeros
        name="ejkernel_gdr_chunk_output",
        BV=plan.block_v,
        **sizes,
        **common,
    )
    return o, ht


def _forward_dense(s: Static, has_h0: bool, q, k, v, g, beta, h0):  # noqa: ANN001, ANN202
    b, t = q.shape[:2]
    tab = _chunk_table(b, t, s.plan.chunk, None)
    o, ht = _forward_rows(s, tab, _rows(q), _rows(k), _rows(v), _rows(g), _rows(beta), h0 if has_h0 else None)
    return o.reshape(v.shape), ht


def _forward(s: Static, q, k, v, g, beta, h0, cu):  # noqa: ANN001, ANN202
    """``(o in q's dtype, final state)``; dense calls fold ``vmap`` into the batch, packed ones run per element."""
    out_dtype = q.dtype
    q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    if s.use_qk_l2norm:
        from ejkernel.testing.reference.gated_delta_rule import l2_normalize

        q, k = l2_normalize(q), l2_normalize(k)
    h0_ = jnp.asarray(_DUMMY_F32) if h0 is None else h0.astype(jnp.float32)
    if cu is None:
        run = fold_vmap(
            functools.partial(_forward_dense, s, h0 is not None), (0, 0, 0, 0, 0, 0 if h0 is not None else None), 0
        )
        o, ht = run(q, k, v, g, beta, h0_)
    else:
        tab = _chunk_table(1, q.shape[1], s.plan.chunk, cu)
        o, ht = _forward_rows(s, tab, q[0], k[0], v[0], g[0], beta[0], h0_ if h0 is not None else None)
        o = o[None]
    return o.astype(out_dtype), ht


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def chunk_delta(s: Static, q, k, v, g, beta, h0, cu):  # noqa: ANN001, ANN201
    """``(o, final state)``: the chunked forward, the reference's VJP backward (module docstring)."""
    return _forward(s, q, k, v, g, beta, h0, cu)


def _chunk_delta_fwd(s: Static, q, k, v, g, beta, h0, cu):  # noqa: ANN001, ANN202
    return _forward(s, q, k, v, g, beta, h0, cu), (q, k, v, g, beta, h0, cu)


def _chunk_delta_bwd(s: Static, res: tuple[Any, ...], cotangents: tuple[jax.Array, ...]) -> tuple[Any, ...]:
    return reference_vjp(s, res, cotangents if s.output_final_state else cotangents[:1])


chunk_delta.defvjp(_chunk_delta_fwd, _chunk_delta_bwd)


def gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    cu_seqlens: jax.Array | None = None,
    use_qk_l2norm: bool = False,
    fwd_params: ChunkFwdParams | None = None,
    bwd_params: NoBwdParams | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """The gated delta rule (contract: ``ejkernel.modules.operations.gated_delta_rule``) by the chunked forward.

    Shapes: ``q``, ``k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g``, ``beta [B, T, HV]``, ``initial_state
    [B or N, HV, K, V]``, ``cu_seqlens [N + 1]``; returns ``(o [B, T, HV, V] in q's dtype, final state float32
    or None)``."""
    p = coerce(ChunkFwdParams, fwd_params) or ChunkFwdParams()
    coerce(NoBwdParams, bwd_params)  # checked: a wrong class is an error, never ignored
    q, k, v, g, beta = (jnp.asarray(x) for x in (q, k, v, g, beta))
    dk, dv = int(q.shape[-1]), int(v.shape[-1])
    s = Static(_plan(dk, dv, p), float(dk**-0.5 if scale is None else scale), bool(output_final_state), use_qk_l2norm)
    h0 = None if initial_state is None else jnp.asarray(initial_state)
    cu = None if cu_seqlens is None else jnp.asarray(cu_seqlens)
    o, final = chunk_delta(s, q, k, v, g, beta, h0, cu)
    return o, (final if output_final_state else None)
