"""Triton ``gated_delta_rule`` for training shapes: the chunked kernels of ``ejkernel_triton._delta_chunk_kernels``
(the WY representation), forward (three launches) and backward.

Tokens are cut into chunks of ``chunk_size`` (every packed sequence starts a new chunk; the chunk table is
``ejkernel_triton.gla.chunk``'s, computed on the device, so the call works under ``jit``). ``use_qk_l2norm``
normalizes ``q`` and ``k`` in float32 before the launches (the backward takes the normalization's VJP in XLA).
Grouped value heads read their query/key head in the kernels; ``dq``/``dk`` are computed per value head and
summed over each group afterwards.

Dots: bfloat16 inputs (``v``'s dtype decides) take bfloat16 operands with float32 accumulation, forward and
backward, as flash-linear-attention's kernels do (about 1% off a float32 computation; the conformance
tolerance for bfloat16 is 4%); the states, ``T`` and every sum stay float32, and ``T = (I + A)^-1`` is computed
by float32 dots (single-pass tf32). The forward hands ``q`` and ``k`` to the kernels in bfloat16 then
(normalized in float32 first, with ``use_qk_l2norm``) and stores ``w``, ``U'`` and the per-chunk states, which
only its dots read, in bfloat16; the output comes out of the kernel in ``q``'s dtype. Other inputs: float32
operands at three tf32 passes (``ieee`` in the interpreter, where bfloat16 operands are emulated by rounding).

Gradients: ``jax.custom_vjp`` (residuals: the inputs only). The backward reruns the forward's first two launches
with its own chunk size (``w``, ``u``, ``T``, ``U'`` and the state at each chunk's start), then the reverse pass of
the state's gradient (``dU'``, the gradient at each chunk's end, the initial state's; ``dU'``'s share that needs no
state comes from the tiles each step loads anyway), then one launch for every chunk in parallel: the WY
representation's backward and ``dq``, ``dk``, ``dv``, ``dg``, ``dbeta``. The backward's dots take bfloat16 operands
for bfloat16 inputs (float32 accumulation; ``q``, ``k`` go to the kernels normalized in float32, then rounded, as in
the forward; every sum and the states in registers stay float32; in the interpreter, float32 dots of the rounded
operands), float32 ones at three tf32 passes for other inputs. What only those dots read between launches (``w``,
``U'``, ``dU'``, the states and their gradients at the chunks' ends) is stored in the dots' operand dtype, as the
forward stores its own. Its memory: the per-chunk states and their gradients, ``2 (T / C) * HV * K * V`` in that
dtype per batch row, and ``O(T HV (K + V + C))``. Launch parameters:
:class:`~ejkernel_triton.gla.chunk.ChunkFwdParams` and :class:`~ejkernel_triton.gla.chunk.ChunkBwdParams`
(``chunk_size``, ``block_v``, warps, stages; ``block_k`` is the whole padded head dim here). Declined (``supports``):
head dims above 256, dtypes other than float32, bfloat16 and float16. Key dims above 128 take their own plans on a GPU
(:func:`_plan`: tiles of 256 key channels, within sm_90's 232448 bytes of shared memory per block; checked and timed
on the H200 by ``benchmarks/gpucheck/gdr_fwd_bwd.py --dims 256,256``).

Speed (H200, B4 T4096 H16 K=V=128 bf16, ``use_qk_l2norm``, 2026-12-04, ``benchmarks/gpucheck/gdr_fwd_bwd.py``;
outputs within 1e-2 and gradients within 8e-3 of XLA's): forward **0.89 ms** against XLA's chunked 3.56 (0.82 at
chunks of 64; flash-linear-attention's chunk kernels took 1.16 ms on the issue filer's H200),
forward+backward **3.75 ms** against XLA's 9.30. Before this form's forward (bfloat16 operands, the blocked
inversion; ptxas for sm_90: no spills for bfloat16 inputs where the former spilled 108 to 876 bytes in each of its
three kernels): 2.64 and 4.85 ms. The backward's first form (chunks of 64, value blocks of 64, 2 warps) spilled over
100 KB in every kernel and took 182 ms; it was restructured (the state-free share of ``dU'`` in its own launch, key
tiles fed to the dots as loaded, sums over key dims in blocks of 64 channels, bfloat16 dot operands for bfloat16
inputs) with chunks of 32, value blocks of 32 and 4 warps (ptxas for sm_90: no spills for bfloat16 inputs but 16-40
bytes in ``delta_bwd_qk``); the H200's per-kernel profile of that form (about 2.9 ms of kernels): 1.0 ms in the dq/dk
launch, 0.66 in the reverse state pass, 0.44 in the WY backward, 0.36 and 0.33 in the rerun of the forward's first two
launches, 0.21 in the state-free share of ``dU'``. Since then (not yet timed on a GPU): the intermediates that only
dots read are stored in bfloat16 (half the bytes of the per-chunk states and their gradients, the largest arrays), the
state-free share of ``dU'`` moved into the reverse state pass, which prefetches its tiles now (two stages), and the WY
backward and the dq/dk launch are one (no ``dvb``, ``dP``, ``D`` round trips); six launches became four (ptxas for
sm_90: no spills for bfloat16 inputs). Registered above XLA on GPUs, below the fused recurrent decode kernel.

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
from ejkernel_triton.gla import chunk as gla_chunk
from ejkernel_triton.gla.chunk import ChunkBwdParams, ChunkFwdParams, _chunk_table, _group_sum, _pow2, _rows

__all__ = ["candidate_cfgs", "gated_delta_rule", "heuristic_cfg", "supports"]

OP = "gated_delta_rule"
_DUMMY_F32 = np.zeros((1,), np.float32)
_BLOCK_KC = 64  # key channels per step of the backward's per-chunk kernels (their sums over key dims loop)
_BLOCK_VG = 16  # value channels per step of delta_bwd_grads (at 32 ptxas spilled 36 bytes for sm_90 at 255 registers)
_WIDE_K = 128  # key dims above take _plan's plans for key tiles of 256 channels (sm_90's shared memory)


@dataclasses.dataclass(frozen=True)
class Plan:
    chunk: int
    block_v: int
    num_warps: int
    num_stages: int
    state_v: int  # the forward state pass's value block (block_v or narrower: _plan)
    state_warps: int = 0  # the state pass's warps and stages (0: num_warps, num_stages)
    state_stages: int = 0


def _plan(
    dk: int, dv: int, p: ChunkFwdParams | ChunkBwdParams, dtype: Any = jnp.bfloat16, states: int | None = None
) -> Plan:
    """``p``'s fields, else the heuristic's: chunks of 64 for the forward and 32 for the backward (16 in the
    interpreter), value blocks of 64 channels for the forward and 32 for the backward (all of them in the
    interpreter), 4 warps (the backward: 2 at chunks of 64, where fla saw its WY backward miscompiled on Hopper at
    4), 2 stages for the forward and 3 for the backward (on the H200, 2026-12-04,
    ``benchmarks/results/2026-12-04-h200-gdr-fwd-bwd-3.log``: forward 0.80 ms at chunks of 64 against 0.95 at 32;
    the four-launch backward's forward+backward 2.65 ms at 3 stages, 2.86 at 2, 3.19 at 1; ptxas for sm_90 at
    these defaults, bfloat16, K = V = 128, ``benchmarks/ptxas_report.py``: no spills but 4 bytes in
    ``delta_bwd_grads``). ``block_k``: the kernels take the
    whole padded key dim, so any other value is refused rather than ignored.

    Measured on the H200 (B4 T4096 H16 K=V=128, the forward's three launches timed one by one,
    ``benchmarks/results/2026-12-03-h200-gdr-chunk-launches.log``): chunks of 64 spend most of their time in the
    row-by-row forward substitution of ``delta_prep`` (1.75 ms of 3.08 with single-pass tf32 dots), chunks of 32
    take 2.12 ms in all. That substitution is now a recursive blocked inversion in ``2 log2(C) - 2`` dots and the
    forward's dots take bfloat16 operands for bfloat16 inputs (0.89 ms at chunks of 32 on the H200, 0.82 at 64, 1.03-1.23
    at 8 warps; ptxas for sm_90, bfloat16
    inputs at K = V = 128: no spills at chunks of 32 or 64, value blocks of 32 or 64, 4 or 8 warps, every pairing
    tried; the state pass at chunks of 32 and value blocks of 64 is at 254 registers with 4 warps, 176 with 8; at 64
    and 64 with 4 warps: 214; float32 inputs: 96 bytes spilled in ``delta_prep``, 708 in the state pass, 256 in
    ``delta_output``, about as before). The backward's old default (chunks of 64, value blocks of 64, 2 warps) was
    checked on the GPU and was slow: every kernel spilled (over 100 KB each). The backward's default now (chunks of
    32, value blocks of 32, 4 warps; its six-launch form took 3.75 ms forward+backward on the H200, the fastest of
    the candidates) is chosen by ptxas's reports for sm_90 at K = V = 128. Its four-launch form (module docstring),
    bfloat16 inputs: no spills (``delta_bwd_grads`` 255 registers, its value blocks capped at 16 channels; the
    reverse state pass 230 at two stages); float32 inputs (three tf32 passes): 1352 bytes spilled in the reverse
    state pass (one stage), 452 in ``delta_bwd_grads``, 104 in ``delta_prep`` and 348 in the state pass.

    The forward's state pass (``state_v``) takes value blocks of at most 32 channels when it would have fewer than
    ``gla.chunk._STATE_PROGRAMS`` programs at ``block_v`` (``states`` = sequences x value heads, times the value
    blocks; as gla's state tiles, whatever ``block_v`` was asked for): at B2 T16384 H16 K=V=128 (64 programs at 64)
    the forward took 1.80 ms at value blocks of 32 for all three launches against 1.93 at 64 on the H200 (2026-12-04,
    ``benchmarks/results/2026-12-04-h200-gdr-fwd-bwd-B2T16384.log``). ``delta_prep`` and ``delta_output`` keep
    ``block_v``: narrower blocks only repeat their work (``delta_output`` computes a chunk's scores once per value
    block; under Nsight Compute at 32 it took 343 us against fla's 254,
    ``benchmarks/results/2026-12-05-h200-gdr-B2T16384-ncu.log``). For bfloat16 inputs that narrowed state pass
    takes 3 stages: forward 1.220 ms against 1.358 at 2 and 1.244 at 4 (B2 T16384, 4 warps, same run,
    ``benchmarks/results/2026-12-06-h200-gdr-state-sweep.log``).

    Key dims above 128 (key tiles of 256 channels; on a GPU only), bfloat16 inputs: chunks of 32, value blocks of
    64, 4 warps, 2 stages, forward and backward. Checked and timed on the H200 (2026-12-04, B4 T4096 H16 K=V=256,
    ``benchmarks/results/2026-12-04-h200-gdr-fwd-bwd-K256.log``, outputs and gradients within 8.7e-3 of XLA's):
    forward 1.95 ms against 2.35 at (64, 32, 4), 3.16 at (64, 32, 8) and XLA's 6.41; the backward at (32, 64, 4, 2)
    gave forward+backward 5.87 ms against 6.83 at (32, 32, 4, 3), 11.58 at (32, 16, 8, 3) and XLA's 17.91 (all
    with the (64, 32, 8) forward). ptxas for sm_90: 608 bytes spilled in ``delta_states`` and 932 in
    ``delta_state_bwd``, at most 102784 bytes shared. Other inputs (float32, and float16, whose dots take float32
    operands) keep the plans below: at (32, 64, 4) float32 ``delta_output`` is cut to 32 registers and spills 18228
    bytes, ``delta_state_bwd`` 9048. Value blocks of 32 channels for the forward and 16 for the backward, 8 warps
    (chunks and stages as at K = 128: 64 and 2 forward, 32 and 3 backward). The state passes hold ``[256,
    block_v]`` tiles, and at K = 256 the K = 128 defaults' forward (value blocks of 64) needs 279040 bytes of shared
    memory in ``delta_states`` and 262144 in ``delta_output`` for float32 inputs, above sm_90's 232448. Chosen by
    compile reports for sm_90 (``benchmarks/ptxas_report.py gated_delta_rule --dims 256,256``; K=256 V=128 the same
    tiles), checked on the GPU (the conformance suite's float32 cases) but not timed; shared bytes per block,
    registers, spills:

    * forward, bfloat16: ``delta_prep`` 65792, 253, 0; ``delta_states`` 164352, 198, 0; ``delta_output`` 65536,
      157, 0. float32: 131072, 255, 1916; 205312, 255, 1668; 196608, 255, 1352 (float16, whose dots take float32
      operands: the same shared bytes, about the same spills). At 4 warps float32 spilled 3476, 1724 and 3528 bytes
      (same shared bytes); value blocks of 64 overflow (above), chunks of 32 made ptxas cut ``delta_output`` to 32
      registers and spill 19664-20648 bytes.
    * backward, bfloat16: ``delta_prep`` 32896, 102, 0; ``delta_states`` 94720, 170, 0; ``delta_state_bwd`` 125696,
      202, 0; ``delta_bwd_grads`` 22528, 255, 0. float32 (``delta_state_bwd`` at one stage): 65536, 255, 1564;
      168448, 255, 392; 32768, 255, 1548; 61440, 255, 284, against 1964, 1856, 3008 and 312 bytes spilled at the
      K = 128 default (value blocks of 32, 4 warps; 205312 bytes shared in ``delta_states``, which also fits).

    Every candidate of :func:`candidate_cfgs` at K = 256 fits too (checked for bfloat16 and float32)."""
    if p.block_k is not None and p.block_k != _pow2(dk):
        raise ValueError(
            f"ejkernel-triton {OP} (chunked): {type(p).__name__}.block_k must be None or {_pow2(dk)} (the whole "
            f"padded key dim K={dk}), got {p.block_k}"
        )
    bwd = isinstance(p, ChunkBwdParams)
    wide = dk > _WIDE_K and not interpreting()  # key tiles of 256 channels: the docstring
    if wide and jnp.dtype(dtype) == jnp.bfloat16:
        chunk, bv, warps, stages = 32, 64, 4, 2
    elif wide:
        chunk, bv, warps, stages = (32, 16, 8, 3) if bwd else (64, 32, 8, 2)
    else:
        chunk, bv, warps, stages = (32, 32, 4, 3) if bwd else (64, 64, 4, 2)
    if interpreting():
        chunk, bv, stages = 16, _pow2(dv), 1
    chunk = p.chunk_size or chunk
    bv = min(p.block_v or bv, _pow2(dv))
    state_v, state_stages = bv, 0
    if not bwd and not wide and states is not None and states * cdiv(dv, bv) < gla_chunk._STATE_PROGRAMS:
        state_v = min(bv, 32)
        if jnp.dtype(dtype) == jnp.bfloat16 and not interpreting():
            state_stages = 3  # forward 1.220 ms against 1.358 at 2 stages (the docstring)
    warps = p.num_warps or (2 if bwd and chunk == 64 else warps)
    return Plan(chunk, bv, warps, p.num_stages or stages, state_v, p.state_warps or 0, p.state_stages or state_stages)


def _params(cls: type[ChunkFwdParams] | type[ChunkBwdParams], plan: Plan) -> Any:
    return cls(
        chunk_size=plan.chunk,
        block_v=plan.block_v,
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
        state_warps=plan.state_warps or None,
        state_stages=plan.state_stages or None,
    )


def heuristic_cfg(inv: Any, stage: str = "fwd") -> ChunkFwdParams | ChunkBwdParams:
    cls = ChunkFwdParams if stage == "fwd" else ChunkBwdParams
    args = gla_chunk._arguments(inv)
    q, v = args["q"], args["v"]
    states = gla_chunk._n_states(q, v, args.get("cu_seqlens"))
    return _params(cls, _plan(int(q.shape[-1]), int(v.shape[-1]), cls(), q.dtype, states))


def candidate_cfgs(inv: Any, stage: str = "fwd") -> list[ChunkFwdParams] | list[ChunkBwdParams]:
    """The heuristic's first; then chunks of 32 or 64, value blocks of 32 or 64, 4 or 8 warps (the backward:
    chunks of 32 with value blocks of 16 at 4 warps (twice the state passes' programs) or 32 at 8 warps, and
    chunks of 16 with value blocks of 32 at 4 warps, where no kernel of the backward spills on sm_90 for
    bfloat16 inputs; the six-launch form took 3.8-5.8 ms forward+backward on the H200). Key dims above 128 on a
    GPU: after the heuristic's, only plans whose every kernel fits sm_90's shared memory for bfloat16 and float32
    inputs (ptxas_report, see :func:`_plan`): the forward's chunks of 64 with value blocks of 32 at 4 warps, 16 at 8, and
    chunks of 32 with value blocks of 32 at 4 or 8 warps; the backward's chunks of 32 with value blocks of 32 at 4
    or 8 warps or 16 at 4, and chunks of 16 with value blocks of 16 at 8 warps. Key dims up to 128: last, the
    heuristic's with its state passes at the other of 2 and 3 stages."""
    base = heuristic_cfg(inv, stage)
    out: list[Any] = [base]
    args = gla_chunk._arguments(inv)
    others: tuple[tuple[int, int, int], ...] = ((32, 64, 4), (64, 32, 4), (32, 64, 8), (64, 64, 8), (32, 32, 4))
    if stage != "fwd":
        others = ((32, 16, 4), (16, 32, 4), (32, 32, 8))
    cap = base.block_v
    wide = int(args["q"].shape[-1]) > _WIDE_K and not interpreting()
    if wide:  # each fits sm_90's shared memory (_plan)
        others = ((64, 32, 4), (32, 32, 8), (32, 32, 4), (64, 16, 8))
        if stage != "fwd":
            others = ((32, 32, 4), (32, 32, 8), (32, 16, 4), (16, 16, 8))
        cap = _pow2(int(args["v"].shape[-1]))
    candidates = [
        dataclasses.replace(base, chunk_size=c, block_v=min(bv, cap or bv), num_warps=w) for c, bv, w in others
    ]
    if not wide:
        candidates.append(
            dataclasses.replace(base, state_stages=2 if (base.state_stages or base.num_stages) == 3 else 3)
        )
    for p in candidates:
        if p not in out:
            out.append(p)
    return out


def supports(inv: Any) -> str | None:
    """The chunked ``gla``'s rules (dtypes, head dims up to 256), for ``q``, ``g``, ``beta``, ``initial_state``
    (key dims above 128 take their own plans on a GPU: :func:`_plan`)."""
    reason = gla_chunk.supports(inv)
    args = gla_chunk._arguments(inv)
    beta = args.get("beta")
    if reason is None and beta is not None and np.dtype(beta.dtype).name not in ("float32", "bfloat16", "float16"):
        reason = f"ejkernel-triton {OP} (chunked): beta dtype {np.dtype(beta.dtype).name} is not supported"
    return reason


@dataclasses.dataclass(frozen=True)
class Static:
    """Everything static about one call: the custom_vjp's non-differentiable argument."""

    fwd: Plan
    bwd: Plan
    scale: float
    output_final_state: bool
    use_qk_l2norm: bool


def _dots(dtype: Any) -> dict[str, Any]:
    """Every kernel's dots for inputs of ``dtype`` (``v``'s): bfloat16 inputs take bfloat16 operands (float32
    accumulation; the states and every sum stay float32), others float32 operands at three tf32 passes; in the
    interpreter, float32 dots of operands rounded as on a GPU (``EMU``). ``TPREC``: ``delta_prep``'s float32
    dots that invert ``I + A`` (single-pass tf32 for bfloat16 inputs, whose ``T`` then goes to bfloat16
    operands; three passes for the others; ``ieee`` in the interpreter)."""
    dot = "bf16" if np.dtype(dtype).name == "bfloat16" else "fp32"
    if interpreting():
        return {"DOT": dot, "EMU": dot != "fp32", "PREC": "ieee", "TPREC": "ieee"}
    prec = "tf32" if dot != "fp32" else "tf32x3"
    return {"DOT": dot, "EMU": False, "PREC": prec, "TPREC": prec}


def _operand_dtype(dtype: Any) -> Any:
    """The dtype the forward hands ``q``, ``k`` to the kernels in and stores ``w``, ``U'`` and the per-chunk
    states in for inputs of ``dtype``: the dots' operand dtype (their dots round them to it anyway)."""
    return jnp.bfloat16 if _dots(dtype)["DOT"] == "bf16" else jnp.float32


def _launch_common(plan: Plan, h: int, hv: int, dk: int, dv: int) -> dict[str, Any]:
    """The constexprs and launch options every kernel of ``plan`` takes."""
    return {
        "H": h,
        "HV": hv,
        "DK": dk,
        "DV": dv,
        "BT": plan.chunk,
        "BK": _pow2(dk),
        "BV": plan.block_v,
        "num_warps": plan.num_warps,
        "num_stages": plan.num_stages,
    }


def _prologue(plan: Plan, tab: Any, k, v, g, beta, h0, store_t: bool, inter: Any):  # noqa: ANN001, ANN202
    """What the forward and the backward both need: ``(w, u, b, T or None, U', the state at each chunk's start,
    the final state)``: ``w``, ``u``, ``U'`` and the states at the chunks' starts in ``inter``, the others float32
    (``u`` in ``inter`` as fla stores it: bfloat16 inputs halve the bytes that ``delta_prep`` writes and the state
    pass reads, ``[R, HV, V]`` each; ``U' = u - w S`` is then formed in float32 from the rounded ``u``)."""
    from ejkernel_triton import _delta_chunk_kernels as kern
    from ejkernel_triton import launch

    r, h, dk = k.shape
    hv, dv = v.shape[1], v.shape[2]
    f32 = jnp.float32
    common = {**_launch_common(plan, h, hv, dk, dv), **_dots(v.dtype)}
    state_common = {n: x for n, x in common.items() if n != "TPREC"}
    w, u, b, t = launch.launch(
        kern.delta_prep,
        k,
        v,
        g,
        beta,
        tab.cu,
        tab.seq,
        tab.off,
        out_shape=(
            jax.ShapeDtypeStruct((r, hv, dk), inter),
            jax.ShapeDtypeStruct((r, hv, dv), inter),
            jax.ShapeDtypeStruct((r, hv), f32),
            jax.ShapeDtypeStruct((tab.nt, hv, plan.chunk, plan.chunk) if store_t else (1,), f32),
        ),
        grid=(tab.nt, hv),
        name="ejkernel_gdr_chunk_prep",
        STORE_T=store_t,
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
            jax.ShapeDtypeStruct((r, hv, dv), inter),
            jax.ShapeDtypeStruct((tab.nt, hv, dk, dv), inter),
            jax.ShapeDtypeStruct((tab.n, hv, dk, dv), f32),
        ),
        grid=(tab.n * cdiv(dv, plan.state_v), hv),
        name="ejkernel_gdr_chunk_states",
        HAS_H0=h0 is not None,
        **{
            **state_common,
            "BV": plan.state_v,
            "num_warps": plan.state_warps or plan.num_warps,
            "num_stages": plan.state_stages or plan.num_stages,
        },
    )
    return w, u, b, (t if store_t else None), uc, hs, ht


def _forward_rows(s: Static, tab: Any, q, k, v, g, beta, h0, out_dtype):  # noqa: ANN001, ANN202
    """``(o [R, HV, V] in out_dtype, final state [N, HV, K, V] float32)`` of token rows laid out by ``tab``."""
    from ejkernel_triton import _delta_chunk_kernels as kern
    from ejkernel_triton import launch

    plan = s.fwd
    r, h, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    _, _, b, _, uc, hs, ht = _prologue(plan, tab, k, v, g, beta, h0, False, _operand_dtype(v.dtype))
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
        out_shape=(jax.ShapeDtypeStruct((r, hv, dv), out_dtype),),
        grid=(tab.nt * cdiv(dv, plan.block_v), hv),
        zeroed_outputs=tab.zeroed(0),  # tokens outside every sequence give zeros
        name="ejkernel_gdr_chunk_output",
        **{n: x for n, x in {**_launch_common(plan, h, hv, dk, dv), **_dots(v.dtype)}.items() if n != "TPREC"},
    )
    return o, ht


def _backward_rows(s: Static, tab: Any, q, k, v, g, beta, h0, do, dht):  # noqa: ANN001, ANN202
    """``(dq, dk [R, HV, K] per value head, dv [R, HV, V] in v's dtype, dg, dbeta [R, HV], dh0 [N, HV, K, V])``,
    float32 but ``dv``."""
    from ejkernel_triton import _delta_chunk_kernels as kern
    from ejkernel_triton import launch

    plan = s.bwd
    r, h, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    f32, op = jnp.float32, _operand_dtype(v.dtype)
    w, _, b, t, uc, hs, _ = _prologue(plan, tab, k, v, g, beta, h0, True, op)
    common = {n: x for n, x in {**_launch_common(plan, h, hv, dk, dv), **_dots(v.dtype)}.items() if n != "TPREC"}
    # key blocks of at most 2048 / C channels: at chunks of 64, 64 channels spilled in delta_bwd_grads (sm_90)
    bkc = min(_BLOCK_KC, _pow2(dk), 2048 // plan.chunk)
    blocked = {**{n: x for n, x in common.items() if n != "BK"}, "BKC": bkc}
    rows_v_op = jax.ShapeDtypeStruct((r, hv, dv), op)
    duc, dhe, dh0 = launch.launch(
        kern.delta_state_bwd,
        q,
        k,
        w,
        b,
        do,
        jnp.asarray(_DUMMY_F32) if dht is None else dht,
        tab.cu,
        tab.off,
        float(s.scale),
        out_shape=(
            rows_v_op,
            jax.ShapeDtypeStruct((tab.nt, hv, dk, dv), op),
            jax.ShapeDtypeStruct((tab.n, hv, dk, dv), f32),
        ),
        grid=(tab.n * cdiv(dv, plan.block_v), hv),
        name="ejkernel_gdr_chunk_state_bwd",
        HAS_DHT=dht is not None,
        BKC=bkc,
        # float32 operands at three tf32 passes: one stage (prefetching the next chunk's tiles made the state pass
        # spill 2 KB for sm_90, 1.3 KB at one stage); bfloat16 ones: the plan's (tiles prefetched into shared memory)
        **{
            **common,
            "num_warps": plan.state_warps or plan.num_warps,
            "num_stages": 1 if common["DOT"] == "fp32" else plan.state_stages or plan.num_stages,
        },
    )
    rows_1 = jax.ShapeDtypeStruct((r, hv), f32)
    rows_k = jax.ShapeDtypeStruct((r, hv, dk), f32)
    dq, dk_, dv_, dg, dbeta = launch.launch(
        kern.delta_bwd_grads,
        q,
        k,
        v,
        beta,
        b,
        t,
        hs,
        uc,
        duc,
        do,
        dhe,
        tab.cu,
        tab.seq,
        tab.off,
        float(s.scale),
        out_shape=(rows_k, rows_k, jax.ShapeDtypeStruct(v.shape, v.dtype), rows_1, rows_1),
        grid=(tab.nt, hv),
        zeroed_outputs=tab.zeroed(0, 1, 2, 3, 4),  # tokens outside every sequence get no gradient
        name="ejkernel_gdr_chunk_bwd_grads",
        **{**blocked, "BV": min(_BLOCK_VG, plan.block_v)},
    )
    return dq, dk_, dv_, dg, dbeta, dh0


def _forward_dense(s: Static, has_h0: bool, out_dtype: Any, q, k, v, g, beta, h0):  # noqa: ANN001, ANN202
    b, t = q.shape[:2]
    tab = _chunk_table(b, t, s.fwd.chunk, None)
    o, ht = _forward_rows(
        s, tab, _rows(q), _rows(k), _rows(v), _rows(g), _rows(beta), h0 if has_h0 else None, out_dtype
    )
    return o.reshape(v.shape), ht


def _backward_dense(s: Static, has_h0: bool, has_dht: bool, q, k, v, g, beta, h0, do, dht):  # noqa: ANN001, ANN202
    b, t, h, _ = q.shape
    tab = _chunk_table(b, t, s.bwd.chunk, None)
    dq, dk, dv, dg, dbeta, dh0 = _backward_rows(
        s,
        tab,
        _rows(q),
        _rows(k),
        _rows(v),
        _rows(g),
        _rows(beta),
        h0 if has_h0 else None,
        _rows(do),
        dht if has_dht else None,
    )
    return (
        _group_sum(dq, h).reshape(q.shape),
        _group_sum(dk, h).reshape(k.shape),
        dv.reshape(v.shape),
        dg.reshape(g.shape),
        dbeta.reshape(beta.shape),
        dh0,
    )


def _kernel_qk(use_qk_l2norm: bool, q, k):  # noqa: ANN001, ANN202
    """``q``, ``k`` in float32, normalized (in float32) with ``use_qk_l2norm``."""
    from ejkernel.testing.reference.gated_delta_rule import l2_normalize

    q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    return (l2_normalize(q), l2_normalize(k)) if use_qk_l2norm else (q, k)


def _forward(s: Static, q, k, v, g, beta, h0, cu):  # noqa: ANN001, ANN202
    """``(o in q's dtype, final state)``; dense calls fold ``vmap`` into the batch, packed ones run per element.
    ``q``, ``k`` go to the kernels in the dots' operand dtype (bfloat16 inputs: as they are, or normalized in
    float32 and then rounded, as flash-linear-attention does)."""
    out_dtype = q.dtype
    op = _operand_dtype(v.dtype)
    if s.use_qk_l2norm or q.dtype != op or k.dtype != op:
        q, k = (x.astype(op) for x in _kernel_qk(s.use_qk_l2norm, q, k))
    h0_ = jnp.asarray(_DUMMY_F32) if h0 is None else h0.astype(jnp.float32)
    if cu is None:
        run = fold_vmap(
            functools.partial(_forward_dense, s, h0 is not None, out_dtype),
            (0, 0, 0, 0, 0, 0 if h0 is not None else None),
            0,
        )
        o, ht = run(q, k, v, g, beta, h0_)
    else:
        tab = _chunk_table(1, q.shape[1], s.fwd.chunk, cu)
        o, ht = _forward_rows(s, tab, q[0], k[0], v[0], g[0], beta[0], h0_ if h0 is not None else None, out_dtype)
        o = o[None]
    return o, ht


def _backward(s: Static, res: tuple[Any, ...], cotangents: tuple[jax.Array, ...]) -> tuple[Any, ...]:
    q_in, k_in, v, g, beta, h0, cu = res
    (q, k), qk_vjp = jax.vjp(functools.partial(_kernel_qk, s.use_qk_l2norm), q_in, k_in)
    q, k = q.astype(_operand_dtype(v.dtype)), k.astype(_operand_dtype(v.dtype))  # as the forward's kernels took them
    do = cotangents[0]
    dht = cotangents[1].astype(jnp.float32) if s.output_final_state else None  # else the final state is dropped
    has_h0, has_dht = h0 is not None, dht is not None
    h0_ = jnp.asarray(_DUMMY_F32) if h0 is None else h0.astype(jnp.float32)
    dht_ = jnp.asarray(_DUMMY_F32) if dht is None else dht
    if cu is None:
        run = fold_vmap(
            functools.partial(_backward_dense, s, has_h0, has_dht),
            (0, 0, 0, 0, 0, 0 if has_h0 else None, 0, 0 if has_dht else None),
            0,
        )
        dq, dk, dv, dg, dbeta, dh0 = run(q, k, v, g, beta, h0_, do, dht_)
    else:
        h = q.shape[2]
        tab = _chunk_table(1, q.shape[1], s.bwd.chunk, cu)
        dq, dk, dv, dg, dbeta, dh0 = _backward_rows(
            s, tab, q[0], k[0], v[0], g[0], beta[0], h0_ if has_h0 else None, do[0], dht_ if has_dht else None
        )
        dq, dk = _group_sum(dq, h)[None], _group_sum(dk, h)[None]
        dv, dg, dbeta = dv[None], dg[None], dbeta[None]
    dq, dk = qk_vjp((dq, dk))  # back through the normalization (and the float32 cast)
    return (
        dq.astype(q_in.dtype),
        dk.astype(k_in.dtype),
        dv.astype(v.dtype),
        dg.astype(g.dtype),
        dbeta.astype(beta.dtype),
        None if h0 is None else dh0.astype(h0.dtype),
        None,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def chunk_delta(s: Static, q, k, v, g, beta, h0, cu):  # noqa: ANN001, ANN201
    """``(o, final state)`` by the chunked kernels (forward and backward, module docstring); ``cu`` gets no
    gradient, ``h0`` any float dtype (its gradient has it)."""
    return _forward(s, q, k, v, g, beta, h0, cu)


def _chunk_delta_fwd(s: Static, q, k, v, g, beta, h0, cu):  # noqa: ANN001, ANN202
    return _forward(s, q, k, v, g, beta, h0, cu), (q, k, v, g, beta, h0, cu)


chunk_delta.defvjp(_chunk_delta_fwd, _backward)


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
    bwd_params: ChunkBwdParams | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """The gated delta rule (contract: ``ejkernel.modules.operations.gated_delta_rule``) by the chunked kernels.

    Shapes: ``q``, ``k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g``, ``beta [B, T, HV]``, ``initial_state
    [B or N, HV, K, V]``, ``cu_seqlens [N + 1]``; returns ``(o [B, T, HV, V] in q's dtype, final state float32
    or None)``."""
    fp = coerce(ChunkFwdParams, fwd_params) or ChunkFwdParams()
    bp = coerce(ChunkBwdParams, bwd_params) or ChunkBwdParams()
    q, k, v, g, beta = (jnp.asarray(x) for x in (q, k, v, g, beta))
    dk, dv = int(q.shape[-1]), int(v.shape[-1])
    states = gla_chunk._n_states(q, v, cu_seqlens)
    s = Static(
        _plan(dk, dv, fp, q.dtype, states),
        _plan(dk, dv, bp, q.dtype, states),
        float(dk**-0.5 if scale is None else scale),
        bool(output_final_state),
        bool(use_qk_l2norm),
    )
    h0 = None if initial_state is None else jnp.asarray(initial_state)
    cu = None if cu_seqlens is None else jnp.asarray(cu_seqlens)
    o, final = chunk_delta(s, q, k, v, g, beta, h0, cu)
    return o, (final if output_final_state else None)
