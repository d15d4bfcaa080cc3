"""Triton ``gla`` for training shapes: the chunked kernels of ``ejkernel_triton._chunk_kernels``, forward and backward.

Tokens are cut into chunks of ``chunk_size`` (every packed sequence starts a new chunk). The forward runs four
launches: the chunk-local cumulative gates, the state at every chunk's start (one sequential pass over the
chunks per sequence, value head and state tile), the intra-chunk scores and the output. The backward
(``jax.custom_vjp``, residuals: the inputs and, when both passes cut the same chunks, the forward's intra-chunk
scores ``A`` and its cumulative gates in place of float32 gates) recomputes the states (and the gates and ``A``
otherwise) and runs the reverse state-gradient pass,
``dA``, ``dv``, the intra-chunk shares of ``dq``/``dk``, then ``dq``/``dk`` and the gates' gradient (chunk by
chunk, from the states and their gradients: no reverse cumulative sum over the sequence). Its memory: the per-chunk
states and their gradients, ``2 (T / C) * HV * K * V`` float32 per batch row, and ``O(T (K + V + C))``; the
residual ``A``: about ``T * HV * C`` per batch row (bfloat16 for bfloat16 inputs, else float32).

Packed sequences (``cu_seqlens``): the chunk table (which sequence, which rows) is computed from ``cu_seqlens`` by
a few XLA ops on the device (:func:`_chunk_table`), so the call works under ``jit``; the kernels read it. Grouped
value heads read their query/key head in the kernels; ``dq``/``dk`` are summed over each group afterwards.

Dots: bfloat16 inputs' take bfloat16 operands (the gate factors applied in float32 first) with float32
accumulation; those that the final state, the initial state's and the gates' gradients are made of split their
float32 operand in two bfloat16 parts, so these reach float32 accuracy for bfloat16 inputs too (the conformance
suite compares them at float32 tolerance). float32 and float16 inputs' dots take float32 operands at three tf32
passes (float16 operands made of states or gradients could overflow). Gate cumulative sums and states are
float32 throughout (the forward's chunk states and ``A``, which only feed dots, are stored in the dots' operand
dtype). Launch parameters: :class:`ChunkFwdParams` and
:class:`ChunkBwdParams` (None fields: :func:`heuristic_cfg`'s). Declined (``supports``): head dims above 256,
dtypes other than float32, bfloat16 and float16.

Importing this module does not import Triton.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.device import cdiv, fold_vmap, next_power_of_2
from ejkernel.kernels.params import MappedParams, check_positive, coerce

from ejkernel_triton._decode import interpreting

__all__ = ["ChunkBwdParams", "ChunkFwdParams", "Plan", "candidate_cfgs", "gla", "heuristic_cfg", "supports"]

OP = "gla"
_MAX_HEAD_DIM = 256
_DTYPES = ("float32", "bfloat16", "float16")
_CHUNK_SIZES = (16, 32, 64)
_DEFAULT_CHUNK = 64
_DEFAULT_BLOCK = 64  # key/value channels per program (head dims above it are tiled)


# ------------------------------------------------------------------------------------------------
# Launch parameters and plans.
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _ChunkParams(MappedParams):
    GENERIC: ClassVar[dict[str, str]] = {
        "q_blocksize": "chunk_size",
        "num_warps": "num_warps",
        "num_stages": "num_stages",
    }
    chunk_size: int | None = None
    block_k: int | None = None
    block_v: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    state_warps: int | None = None
    state_stages: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(self, "chunk_size", power_of_two=True, within=(16, 64))
        check_positive(self, "block_k", power_of_two=True, within=(16, _MAX_HEAD_DIM))
        check_positive(self, "block_v", power_of_two=True, within=(16, _MAX_HEAD_DIM))
        check_positive(self, "num_warps", power_of_two=True, within=(1, 16))
        check_positive(self, "num_stages", within=(1, 8))
        check_positive(self, "state_warps", power_of_two=True, within=(1, 16))
        check_positive(self, "state_stages", within=(1, 8))


@dataclasses.dataclass(frozen=True)
class ChunkFwdParams(_ChunkParams):
    """Launch parameters of the chunked Triton ``gla`` forward.

    ``chunk_size``: tokens per chunk, 16, 32 or 64; ``block_k``/``block_v``: key/value channels per program of the
    chunk-parallel kernels (the sequential state passes take the heuristic's tiles, sized by the number of sequences
    and value heads), powers of two from 16 to 256, used up to the head dims rounded up to powers of two;
    ``num_warps`` (a power of two up to 16; not of ``chunk_intra_diag``, ``chunk_intra_offdiag`` and
    ``chunk_dqk_intra``, whose small tiles take fewer), ``num_stages`` (1 to 8); ``state_warps``/``state_stages``:
    the same for the sequential state passes (one program per state tile walking every chunk: their own launch).
    None: the heuristic's. Generic ``q_blocksize``/``num_warps``/``num_stages`` map to
    ``chunk_size``/``num_warps``/``num_stages``.

    >>> ChunkFwdParams(chunk_size=48)
    Traceback (most recent call last):
    ValueError: ChunkFwdParams.chunk_size must be a power of two from 16 to 64 or None, got 48
    """


@dataclasses.dataclass(frozen=True)
class ChunkBwdParams(_ChunkParams):
    """Launch parameters of the chunked Triton ``gla`` backward (it recomputes the forward's chunk states with its
    own ``chunk_size``); the fields are :class:`ChunkFwdParams`'."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """One pass's launch: chunk length, key/value tile, warps, stages, and the state passes' tile ``[state_k,
    state_v]``, warps and stages (``chunk_state_fwd`` / ``chunk_state_bwd``: sequential over the chunks, so their
    own launch)."""

    chunk: int
    block_k: int
    block_v: int
    num_warps: int
    num_stages: int
    state_k: int
    state_v: int
    state_warps: int = 8
    state_stages: int = 2
    # The backward's two state walks in one launch (_state_pair), two chains side by side on the SMs: not the
    # default until the H200 has checked and timed it (benchmarks/gpucheck/gla_state_pair.py)
    paired_states: bool = False
    # The forward's unsplit state walk reads decayed keys k exp(b_L - b) that chunk_intra_diag writes in the dots'
    # operand dtype instead of k and the float32 gates (state_walk_fwd's DECAYED): not the default until the H200
    # has checked and timed it (benchmarks/gpucheck/gla_state_pair.py, check_decayed)
    decayed_keys: bool = False


class Dims(NamedTuple):
    """Head dims, and the states that the state passes walk: sequences times value heads (0: unknown)."""

    dk: int
    dv: int
    states: int = 0


def _pow2(n: int) -> int:
    return max(16, next_power_of_2(n))


def _arguments(invocation: Any) -> Mapping[str, Any]:
    args = getattr(invocation, "arguments", invocation)
    if not isinstance(args, Mapping):
        raise TypeError(f"expected an invocation with an .arguments mapping, got {type(invocation).__name__}")
    return args


def _dims_of(invocation: Any) -> Dims:
    args = _arguments(invocation)
    return Dims(
        int(args["q"].shape[-1]), int(args["v"].shape[-1]), _n_states(args["q"], args["v"], args.get("cu_seqlens"))
    )


def _n_states(q: Any, v: Any, cu_seqlens: Any) -> int:
    """Sequences times value heads of a call (the programs of a state pass per state tile)."""
    n = int(q.shape[0]) if cu_seqlens is None else int(cu_seqlens.shape[0]) - 1
    return max(n, 1) * int(v.shape[2])


# Programs that the state passes (sequential over the chunks) should fill at least: about one wave of an H200's 132
# SMs at one program per SM (they take 130 to 255 registers a thread at 8 warps). Checked and timed on an H200
# (2026-12-04: forward+backward 9.7 -> 6.64 ms at B4 T4096 H16 K=V=128 with this and the changes beside it).
_STATE_PROGRAMS = 128


def _state_tile(d: Dims) -> tuple[int, int]:
    """The state passes' tile: the largest of ``[128, 64]``, ``[64, 64]``, ``[64, 32]`` (cut to the padded head
    dims) that still gives ``_STATE_PROGRAMS`` programs (each walks all chunks of its sequence, so fewer, larger
    tiles take fewer waves of the same length), else the smallest; the largest when the states are unknown."""
    k_big, k, v = (
        min(2 * _DEFAULT_BLOCK, _pow2(d.dk)),
        min(_DEFAULT_BLOCK, _pow2(d.dk)),
        min(_DEFAULT_BLOCK, _pow2(d.dv)),
    )
    tiles = ((k_big, v), (k, v), (k, min(_DEFAULT_BLOCK // 2, _pow2(d.dv))))
    for bk, bv in tiles:
        if d.states == 0 or d.states * cdiv(d.dk, bk) * cdiv(d.dv, bv) >= _STATE_PROGRAMS:
            return bk, bv
    return tiles[-1]


def default_plan(d: Dims, stage: str = "fwd") -> Plan:
    """The heuristic: chunks of 64, key/value tiles of up to 64 x 64 channels (the forward's value tiles up to 128:
    ``chunk_output`` then reads ``q``, the gates and ``A`` once per chunk; forward 1.68 ms against 1.91 at 64 on
    the H200, and 1.84 against 1.89 in an earlier run, ``2026-12-04-h200-gla-chunk-{3,2}.log``; ptxas for sm_90: no
    spills, bfloat16 or float32), state passes' tiles by
    :func:`_state_tile` (128 x 64 at K = V = 128 with 64 or more sequences x value heads), 8 warps (but
    :func:`_block_launch`'s), 2 stages. The state passes at 8 warps and 2 stages on 128 x 64 tiles, at 4 warps and
    3 stages on smaller ones (B2 T16384 H16 K=V=128 on the H200, tile 64 x 64, forward / recomputed / backward
    state pass: 0.459 / 0.593 / 0.596 ms against 0.646 / 0.755 / 0.754 at 8 warps and 2 stages; on 128 x 64 tiles 8
    warps stayed the faster, 3 stages mixed; ``benchmarks/results/2026-12-06-h200-gla-state-sweep.log``). ptxas
    for sm_90 at K = V = 128 (``benchmarks/ptxas_report.py``): no kernel
    of either pass spills registers for bfloat16 inputs (``chunk_dqk_inter`` takes the most, 184 registers a
    thread; ``chunk_intra_diag`` 96 at 4 warps (212 at K = 256), ``chunk_intra_offdiag`` 179 at 1,
    ``chunk_dqk_intra`` 128 at 4); for float32 inputs ``chunk_dqk_inter`` spills 448 bytes (none at the backward's
    value tiles of 32, its default before). Tiles of 64 were the faster on the
    H200 (B4 T4096 H16 K=V=128 bf16, ``benchmarks/results/2026-12-04-h200-gla-chunk-2.log``: forward + backward
    5.68 ms against 6.09)."""
    bk = min(_DEFAULT_BLOCK, _pow2(d.dk))
    bv = min(2 * _DEFAULT_BLOCK if stage == "fwd" else _DEFAULT_BLOCK, _pow2(d.dv))
    sk, sv = _state_tile(d)
    state_warps, state_stages = (8, 2) if sk * sv > _DEFAULT_BLOCK * _DEFAULT_BLOCK else (4, 3)
    return Plan(_DEFAULT_CHUNK, bk, bv, 8, 2, sk, sv, state_warps, state_stages)


def make_plan(d: Dims, p: _ChunkParams, stage: str = "fwd") -> Plan:
    """The plan of a pass: ``p``'s fields, the others (and the state passes' tile) the heuristic's (tiles used up to
    the padded head dims)."""
    base = default_plan(d, stage)
    bk = min(p.block_k or base.block_k, _pow2(d.dk))
    bv = min(p.block_v or base.block_v, _pow2(d.dv))
    return Plan(
        chunk=p.chunk_size or base.chunk,
        block_k=bk,
        block_v=bv,
        num_warps=p.num_warps or base.num_warps,
        num_stages=p.num_stages or base.num_stages,
        state_k=base.state_k,
        state_v=base.state_v,
        state_warps=p.state_warps or base.state_warps,
        state_stages=p.state_stages or base.state_stages,
        paired_states=base.paired_states,
        decayed_keys=base.decayed_keys,
    )


# chunk_intra_offdiag and chunk_dqk_intra take a chunk by blocks of this many rows (a dot's smallest side), the
# backward the pairs inside a block in log2 of it levels (_chunk_kernels.level); chunk_intra_diag the forward's.
_BLOCK_ROWS = 16
_BLOCK_LEVELS = _BLOCK_ROWS.bit_length() - 1
# chunk_intra_diag's warps (its programs hold a block's rows of q and the gates, all key channels, in float32,
# twice: in order and reversed). H200, B4 T4096 H16 K=V=128 bf16, Nsight Compute, 1 / 2 / 4 / 8 warps: 362 / 285 /
# 267 / 392 us (benchmarks/results/2026-12-05-h200-gla-intra-split.log).
_DIAG_WARPS = 4


def _block_launch(plan: Plan, dot: str, kernel: str) -> dict[str, Any]:
    """Warps and block constexprs of ``chunk_intra_offdiag`` / ``chunk_dqk_intra`` (``kernel``: ``"attn"`` or
    ``"dqk"``) for dots in ``dot``: small tiles, so few warps (several programs per SM), not the plan's. Timed on
    the H200 (B4 T4096 H16 K=V=128, chunks of 64, each launch alone, 2 / 4 / 8 warps, ms;
    ``benchmarks/results/2026-12-04-h200-gla-intra-blocks.log``): the intra-chunk scores (then one kernel for all
    blocks) bf16 0.689 / 0.838 / 1.872,
    f32 0.805 / 1.312 / 2.401; ``chunk_dqk_intra`` bf16 0.800 / 0.742 / 1.159, f32 (key tiles of 32) 0.918 / 0.974
    / 1.902 (the level kernels they replace, one 8-warp program per chunk: 1.070, 1.207, 1.679, 3.298). float16
    inputs take float32 dots (``_DOT``), so float32's warps. ``chunk_intra_offdiag`` alone (the blocks below the
    diagonal; bf16, Nsight Compute, 1 / 2 / 4 warps): 169 / 197 / 238 us (``benchmarks/results/2026-12-05-h200-gla-intra-split.log``)."""
    if dot == "bf16":
        warps = 4 if kernel == "dqk" else 1
    else:
        warps = 2
    return {"num_warps": warps, "num_stages": plan.num_stages, "BC": _BLOCK_ROWS, "LEVELS": _BLOCK_LEVELS}


def _params(cls: type[_ChunkParams], plan: Plan) -> Any:
    return cls(
        chunk_size=plan.chunk,
        block_k=plan.block_k,
        block_v=plan.block_v,
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
        state_warps=plan.state_warps,
        state_stages=plan.state_stages,
    )


def _candidate_plans(d: Dims, stage: str = "fwd") -> list[Plan]:
    """The heuristic's plan first; in Triton's interpreter one other (chunks of 16), on a GPU chunks of 64 and 32
    with value tiles of 32 and 64 channels (and 128 for the forward: ``chunk_output`` then reads ``q`` and the
    gates once per chunk), key tiles of the heuristic's and 32 channels for the backward (32: about half the
    registers of ``chunk_dqk_inter``, two programs per SM), 8 or 4 warps; then the heuristic's with the state passes
    at the other of 4 and 8 warps, and at 3 stages (14 plans at K = V = 128 for the forward, 18 for the backward)."""
    base = default_plan(d, stage)
    if interpreting():
        return [base, dataclasses.replace(base, chunk=16)]
    out = [base]
    key_tiles = (base.block_k,) if stage == "fwd" else (base.block_k, 32)
    value_tiles = (32, 64, 128) if stage == "fwd" else (32, 64)
    for chunk in (64, 32):
        for bk in key_tiles:
            for bv in value_tiles:
                for warps in (8, 4):
                    plan = dataclasses.replace(
                        base,
                        chunk=chunk,
                        block_k=min(bk, _pow2(d.dk)),
                        block_v=min(bv, _pow2(d.dv)),
                        num_warps=warps,
                    )
                    if plan not in out:
                        out.append(plan)
    out.append(dataclasses.replace(base, state_warps=4 if base.state_warps == 8 else 8))
    out.append(dataclasses.replace(base, state_stages=3 if base.state_stages != 3 else 2))
    return out


def heuristic_cfg(inv: Any, stage: str = "fwd") -> ChunkFwdParams | ChunkBwdParams:
    cls = ChunkFwdParams if stage == "fwd" else ChunkBwdParams
    return _params(cls, default_plan(_dims_of(inv), stage))


def candidate_cfgs(inv: Any, stage: str = "fwd") -> list[ChunkFwdParams] | list[ChunkBwdParams]:
    cls = ChunkFwdParams if stage == "fwd" else ChunkBwdParams
    return [_params(cls, p) for p in _candidate_plans(_dims_of(inv), stage)]


def supports(inv: Any) -> str | None:
    """None when the chunked kernels serve the call (of ``gla``, or of an op run on them: ``lightning_attn``,
    ``recurrent``), else why not: dtypes other than float32, bfloat16 and float16, or head dims above 256. Any length
    is served (a decode step is one partly filled chunk)."""
    args = _arguments(inv)
    op = getattr(inv, "op", OP)
    for name in ("q", "g", "g_k", "initial_state"):
        x = args.get(name)
        if x is not None and np.dtype(x.dtype).name not in _DTYPES:
            return f"ejkernel-triton {op} (chunked): {name} dtype {np.dtype(x.dtype).name} is not supported ({', '.join(_DTYPES)})"
    dk, dv = int(args["q"].shape[-1]), int(args["v"].shape[-1])
    if not (1 <= dk <= _MAX_HEAD_DIM and 1 <= dv <= _MAX_HEAD_DIM):
        return f"ejkernel-triton {op} (chunked): head dims from 1 to {_MAX_HEAD_DIM} are supported, got K={dk}, V={dv}"
    if importlib.util.find_spec("triton") is None:  # find, don't import: see ejkernel_triton.launch
        return f"ejkernel-triton {op} (chunked): triton is not installed"
    return None


# ------------------------------------------------------------------------------------------------
# The chunk table and the launches.
# ------------------------------------------------------------------------------------------------


class _Table(NamedTuple):
    """Where every chunk is: ``cu [N + 1]`` rows of the sequences, ``off [N + 1]`` their chunks, ``seq [NT]`` the
    sequence of each chunk (int32; ``NT`` a static bound, chunks past ``off[N]`` are empty)."""

    cu: jax.Array
    off: jax.Array
    seq: jax.Array
    n: int
    nt: int
    dense: bool = False  # rows of equal length, no cu_seqlens: every token is in some chunk

    def zeroed(self, *outputs: int) -> tuple[int, ...]:
        """``launch``'s ``zeroed_outputs`` for outputs whose rows outside every sequence must read zero: none when
        the table is dense (every row is written; a zero fill is a pass over the whole output, e.g. 0.7 GB for
        gla's backward at B2 T16384 H16 K=V=128)."""
        return () if self.dense else outputs


def _chunk_table(b: int, t: int, chunk: int, cu_seqlens: jax.Array | None) -> _Table:
    """The chunk table of ``b`` rows of ``t`` tokens, or of the sequences packed by ``cu_seqlens`` (``b == 1``)."""
    if cu_seqlens is None:
        per = cdiv(t, chunk)
        rows = np.arange(b + 1, dtype=np.int32)
        seqs = np.arange(b * per, dtype=np.int32) // per
        return _Table(jnp.asarray(rows * t), jnp.asarray(rows * per), jnp.asarray(seqs), b, b * per, True)
    n = int(cu_seqlens.shape[0]) - 1
    # Under jit unchecked: clamped into [0, T] and made non-decreasing, so no kernel reads outside the call and
    # the chunks fit the static bound NT = cdiv(T, C) + N.
    cu = jax.lax.cummax(jnp.clip(cu_seqlens.astype(jnp.int32), 0, t))
    chunks = cdiv(cu[1:] - cu[:-1], chunk)
    off = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(chunks).astype(jnp.int32)])
    nt = cdiv(t, chunk) + n
    seq = jnp.searchsorted(off[1:], jnp.arange(nt, dtype=jnp.int32), side="right").astype(jnp.int32)
    return _Table(cu, off, jnp.minimum(seq, n - 1), n, nt)


@dataclasses.dataclass(frozen=True)
class Static:
    """Everything static about one call: the custom_vjp's non-differentiable argument."""

    fwd: Plan
    bwd: Plan
    scale: float
    output_final_state: bool


# Operands of the dots per input dtype: bfloat16 inputs' dots take bfloat16 operands; float16 ones float32 operands
# like float32 inputs' (a float16 operand made of a state or of gradients overflows past 65504).
_DOT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp32"}


def _dots(dtype: Any) -> dict[str, Any]:
    """The dots' constexprs for inputs of ``dtype``: operands in ``_DOT[dtype]``; float32 ones at three tf32 passes
    on a GPU (bfloat16 ones: Triton's default precision, which only float32 operands read); ``"ieee"`` in the
    interpreter, which also emulates bfloat16 operands by rounded float32 ones."""
    dot = _DOT[np.dtype(dtype).name]
    if interpreting():
        return {"PREC": "ieee", "DOT": dot, "EMU": dot != "fp32"}
    return {"PREC": "tf32x3" if dot == "fp32" else "tf32", "DOT": dot, "EMU": False}


_DUMMY_F32 = np.zeros((1,), np.float32)


def _walk_launch(plan: Plan, tab: _Table, h: int, hv: int, dk: int, dv: int, walks: int = 1) -> dict[str, Any]:
    """Grid, warps, stages and shape constexprs of the state walks (``chunk_state_fwd``, ``chunk_state_bwd``;
    ``chunk_state_pair``: ``walks=2``): a program per ``[state_k, state_v]`` tile of each sequence's state."""
    return {
        "grid": (walks * tab.n * cdiv(dk, plan.state_k) * cdiv(dv, plan.state_v), hv),
        "num_warps": plan.state_warps,
        "num_stages": plan.state_stages,
        "H": h,
        "HV": hv,
        "DK": dk,
        "DV": dv,
        "GK": dk,
        "BT": plan.chunk,
        "BK": plan.state_k,
        "BV": plan.state_v,
    }


def _states(
    plan: Plan,
    tab: _Table,
    k: jax.Array,
    v: jax.Array,
    gc: jax.Array,
    h0: jax.Array | None,
    hs_dtype: Any = jnp.float32,
    split: bool = True,
    kd: jax.Array | None = None,
    gv: jax.Array | None = None,
    name: str = "ejkernel_gla_chunk_state_fwd",
) -> Any:
    """``(h [NT, HV, K, V] in hs_dtype, final state [N, HV, K, V] float32)``; ``split``: at float32 accuracy
    (``chunk_state_fwd``'s ``SPLIT``); ``kd``: the decayed keys ``[R, HV, K]`` (:func:`_scores`'), read in place of
    ``k`` and the gate tiles (``DECAYED``; not with ``split``); ``gv [R, HV, V]``: the state's columns decay too, by
    these cumulative gates (``HAS_GV``: the value-gated path, ``ejkernel_triton._value_chunk``)."""
    from ejkernel_triton import _chunk_kernels as kern
    from ejkernel_triton import launch

    _, h, dk = k.shape
    hv, dv = v.shape[1], v.shape[2]
    return launch.launch(
        kern.chunk_state_fwd,
        k if kd is None else kd,
        v,
        gc,
        jnp.asarray(_DUMMY_F32) if gv is None else gv,
        jnp.asarray(_DUMMY_F32) if h0 is None else h0,
        tab.cu,
        tab.off,
        out_shape=(
            jax.ShapeDtypeStruct((tab.nt, hv, dk, dv), hs_dtype),
            jax.ShapeDtypeStruct((tab.n, hv, dk, dv), jnp.float32),
        ),
        name=name,
        **_walk_launch(plan, tab, h, hv, dk, dv),
        HAS_H0=h0 is not None,
        HAS_GV=gv is not None,
        SPLIT=split,
        DECAYED=kd is not None,
        **_dots(k.dtype),
    )


def _dstates(
    plan: Plan, tab: _Table, q: jax.Array, do: jax.Array, gc: jax.Array, dht: jax.Array | None, scale: float, hv: int
) -> Any:
    """``(dh [NT, HV, K, V] float32: the gradient of each chunk's state, dh0 [N, HV, K, V] float32)``, walking the
    chunks backwards."""
    from ejkernel_triton import _chunk_kernels as kern
    from ejkernel_triton import launch

    _, h, dk = q.shape
    dv = do.shape[2]
    f32 = jnp.float32
    return launch.launch(
        kern.chunk_state_bwd,
        q,
        do,
        gc,
        jnp.asarray(_DUMMY_F32),  # no value gate
        jnp.asarray(_DUMMY_F32) if dht is None else dht,
        tab.cu,
        tab.off,
        float(scale),
        out_shape=(
            jax.ShapeDtypeStruct((tab.nt, hv, dk, dv), f32),
            jax.ShapeDtypeStruct((tab.n, hv, dk, dv), f32),
        ),
        name="ejkernel_gla_chunk_state_bwd",
        **_walk_launch(plan, tab, h, hv, dk, dv),
        HAS_DHT=dht is not None,
        HAS_GV=False,
        **_dots(q.dtype),
    )


def _state_pair(
    plan: Plan,
    tab: _Table,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    do: jax.Array,
    gc: jax.Array,
    h0: jax.Array | None,
    dht: jax.Array | None,
    scale: float,
) -> Any:
    """:func:`_states` (float32, split) and :func:`_dstates` in one launch (``chunk_state_pair``): ``(h, dh, dh0)``.
    Each walk is a chain of dependent chunk steps with about one program per SM (128 programs of 64 x 64 tiles at B2
    H16 K=V=128), so the two launches take the sum of two chains; one launch runs both chains side by side."""
    from ejkernel_triton import _chunk_kernels as kern
    from ejkernel_triton import launch

    _, h, dk = k.shape
    hv, dv = v.shape[1], v.shape[2]
    f32 = jnp.float32
    hs, _, dhe, dh0 = launch.launch(
        kern.chunk_state_pair,
        k,
        v,
        q,
        do,
        gc,
        jnp.asarray(_DUMMY_F32) if h0 is None else h0,
        jnp.asarray(_DUMMY_F32) if dht is None else dht,
        tab.cu,
        tab.off,
        float(scale),
        out_shape=(
            jax.ShapeDtypeStruct((tab.nt, hv, dk, dv), f32),
            jax.ShapeDtypeStruct((tab.n, hv, dk, dv), f32),
            jax.ShapeDtypeStruct((tab.nt, hv, dk, dv), f32),
            jax.ShapeDtypeStruct((tab.n, hv, dk, dv), f32),
        ),
        name="ejkernel_gla_chunk_state_pair",
        **_walk_launch(plan, tab, h, hv, dk, dv, walks=2),
        HAS_H0=h0 is not None,
        HAS_DHT=dht is not None,
        **_dots(k.dtype),
    )
    return hs, dhe, dh0


def _operand_dtype(dtype: Any) -> Any:
    """The dtype that the dots round ``A`` and the forward's chunk states to for inputs of ``dtype``: storing them
    in it changes no result (bfloat16 for bfloat16 inputs, else float32)."""
    return jnp.bfloat16 if _DOT[np.dtype(dtype).name] == "bf16" else jnp.float32


def _gate_cumsum(plan: Plan, tab: _Table, g: jax.Array, hv: int) -> jax.Array:
    """The chunk-local cumulative gates ``[R, HV, K]`` float32."""
    from ejkernel_triton import _chunk_kernels as kern
    from ejkernel_triton import launch

    dk = g.shape[2]
    (gc,) = launch.launch(
        kern.chunk_gate_cumsum,
        g,
        tab.cu,
        tab.seq,
        tab.off,
        out_shape=(jax.ShapeDtypeStruct(g.shape, jnp.float32),),
        grid=(tab.nt, hv, cdiv(dk, plan.block_k)),
        num_warps=plan.num_warps,
        num_stages=1,
        name="ejkernel_gla_chunk_gate_cumsum",
        HV=hv,
        GK=dk,
        BT=plan.chunk,
        BK=plan.block_k,
    )
    return gc


def _prologue(
    s: Static,
    plan: Plan,
    tab: _Table,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    h0: jax.Array | None,
    *,
    hs_dtype: Any = jnp.float32,
    a: jax.Array | None = None,
    gc: jax.Array | None = None,
    split: bool = True,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """What the forward and the backward both need: the cumulative gates, the chunk states (in ``hs_dtype``; at
    float32 accuracy when ``split``), the final state and the intra-chunk scores ``A [NT, HV, C, C]`` (in
    :func:`_operand_dtype`; ``a`` and ``gc`` when given: the forward's, saved for the backward). Unsplit states of
    a ``plan.decayed_keys`` walk the decayed keys that the scores' kernel writes (so the scores come first)."""
    hv = v.shape[1]
    op = _operand_dtype(q.dtype)
    gc = _gate_cumsum(plan, tab, g, hv) if gc is None else gc
    if plan.decayed_keys and not split and a is None:
        a, kd = _scores(plan, tab, q, k, gc, hv, s.scale, op, decayed=True)
        hs, ht = _states(plan, tab, k, v, gc, h0, hs_dtype, split, kd=kd)
        return gc, hs, ht, a
    hs, ht = _states(plan, tab, k, v, gc, h0, hs_dtype, split)
    if a is None:
        a, _ = _scores(plan, tab, q, k, gc, hv, s.scale, op)
    return gc, hs, ht, a


def _scores(
    plan: Plan,
    tab: _Table,
    q: jax.Array,
    k: jax.Array,
    gc: jax.Array,
    hv: int,
    scale: float,
    dtype: Any,
    decayed: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """``(A, kd)``: the intra-chunk scores ``A [NT, HV, C, C]`` in ``dtype`` (scale included, zeros above the
    diagonal) from the cumulative gates ``gc [R, HV, K]`` (``chunk_intra_diag``, then ``chunk_intra_offdiag`` into
    the same array) and, when ``decayed``, the decayed keys ``kd = k exp(b_L - b) [R, HV, K]`` in the dots' operand
    dtype (rows outside every chunk unwritten), else None."""
    from ejkernel_triton import _chunk_kernels as kern
    from ejkernel_triton import launch

    _, h, dk = q.shape
    dots = _dots(q.dtype)
    blocks = _block_launch(plan, dots["DOT"], "attn")
    nc = plan.chunk // blocks["BC"]
    sizes = {"H": h, "HV": hv, "DK": dk, "GK": dk, "BT": plan.chunk, "BC": blocks["BC"]}
    args = (q, k, gc, tab.cu, tab.seq, tab.off, float(scale))
    out = jax.ShapeDtypeStruct((tab.nt, hv, plan.chunk, plan.chunk), dtype)
    kd_shape = (gc.shape[0], hv, dk) if decayed else (1,)  # one unwritten element when not asked for
    a, kd = launch.launch(
        kern.chunk_intra_diag,
        *args,
        out_shape=(out, jax.ShapeDtypeStruct(kd_shape, _operand_dtype(q.dtype))),
        grid=(tab.nt, hv, nc),
        num_warps=_DIAG_WARPS,
        num_stages=1,
        name="ejkernel_gla_chunk_intra_diag",
        BKD=_pow2(dk),
        HAS_KD=decayed,
        **sizes,
    )
    (a,) = launch.launch(  # the blocks below the diagonal, into the same array
        kern.chunk_intra_offdiag,
        *args,
        a,
        out_shape=(out,),
        grid=(tab.nt, hv, nc * (nc - 1) // 2),
        num_warps=blocks["num_warps"],
        num_stages=blocks["num_stages"],
        aliases={len(args): 0},
        name="ejkernel_gla_chunk_intra_offdiag",
        BK=plan.block_k,
        **sizes,
        **dots,
    )
    return a, (kd if decayed else None)


def _rows(x: jax.Array) -> jax.Array:
    """``[B, T, heads, D]`` as ``[B T, heads, D]`` (the kernels' rows of tokens)."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _forward_rows(
    s: Static, tab: _Table, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, h0: jax.Array | None
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``(o [R, HV, V], final state, A [NT, HV, C, C], cumulative gates [R, HV, K] float32)`` of token rows laid out
    by ``tab``."""
    from ejkernel_triton import _chunk_kernels as kern
    from ejkernel_triton import launch

    plan = s.fwd
    _, h, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    # The chunk states only feed the output's dots here: stored as those round them, and computed at float32
    # accuracy (one more product per chunk) only for a final state that is returned.
    gc, hs, ht, a = _prologue(
        s, plan, tab, q, k, v, g, h0, hs_dtype=_operand_dtype(q.dtype), split=s.output_final_state
    )
    (o,) = launch.launch(
        kern.chunk_output,
        q,
        v,
        gc,
        hs,
        a,
        tab.cu,
        tab.seq,
        tab.off,
        float(s.scale),
        out_shape=(jax.ShapeDtypeStruct(v.shape, q.dtype),),
        grid=(tab.nt * cdiv(dv, plan.block_v), hv),
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
        zeroed_outputs=tab.zeroed(0),  # tokens outside every sequence give zeros
        name="ejkernel_gla_chunk_output",
        H=h,
        HV=hv,
        DK=dk,
        DV=dv,
        GK=dk,
        BT=plan.chunk,
        BK=plan.block_k,
        BV=plan.block_v,
        **_dots(q.dtype),
    )
    return o, ht, a, gc


def _backward_rows(
    s: Static,
    tab: _Table,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    h0: jax.Array | None,
    do: jax.Array,
    dht: jax.Array | None,
    a: jax.Array | None = None,
    gc: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """``(dq, dk [R, HV, K] per value head (float32 when grouped, else q's dtype), dv [R, HV, V], dg [R, HV, K] float32,
    dh0 [N, HV, K, V])``; ``a``, ``gc``: the forward's intra-chunk scores and cumulative gates (same chunks), else
    recomputed (``g`` is read only then)."""
    from ejkernel_triton import _chunk_kernels as kern
    from ejkernel_triton import launch

    plan = s.bwd
    _, h, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if plan.paired_states:
        gc = _gate_cumsum(plan, tab, g, hv) if gc is None else gc
        hs, dhe, dh0 = _state_pair(plan, tab, q, k, v, do, gc, h0, dht, s.scale)
        a = _scores(plan, tab, q, k, gc, hv, s.scale, _operand_dtype(q.dtype))[0] if a is None else a
    else:
        gc, hs, _, a = _prologue(s, plan, tab, q, k, v, g, h0, a=a, gc=gc)
        dhe, dh0 = _dstates(plan, tab, q, do, gc, dht, s.scale, hv)
    common: dict[str, Any] = {"num_warps": plan.num_warps, "num_stages": plan.num_stages}
    sizes: dict[str, Any] = {"HV": hv, "BT": plan.chunk, **_dots(q.dtype)}
    f32 = jnp.float32
    (da,) = launch.launch(
        kern.chunk_attn_grad,
        do,
        v,
        tab.cu,
        tab.seq,
        tab.off,
        float(s.scale),
        out_shape=(jax.ShapeDtypeStruct(a.shape, f32),),
        grid=(tab.nt, hv),
        name="ejkernel_gla_chunk_attn_grad",
        DV=dv,
        BV=plan.block_v,
        **sizes,
        **common,
    )
    (dv_,) = launch.launch(
        kern.chunk_dv,
        k,
        gc,
        do,
        a,
        dhe,
        tab.cu,
        tab.seq,
        tab.off,
        out_shape=(jax.ShapeDtypeStruct(v.shape, v.dtype),),
        grid=(tab.nt * cdiv(dv, plan.block_v), hv),
        zeroed_outputs=tab.zeroed(0),
        name="ejkernel_gla_chunk_dv",
        H=h,
        DK=dk,
        DV=dv,
        GK=dk,
        BK=plan.block_k,
        BV=plan.block_v,
        **sizes,
        **common,
    )
    dq, dk_, dg = _dqk(plan, tab, q, k, v, gc, do, hs, dhe, da, s.scale)
    return dq, dk_, dv_, dg, dh0


def _dqk(
    plan: Plan,
    tab: _Table,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    gc: jax.Array,
    do: jax.Array,
    hs: jax.Array,
    dhe: jax.Array,
    da: jax.Array,
    scale: float,
    gv: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(dq, dk [R, HV, K] per value head (float32 when grouped, else q's dtype), dg [R, HV, K] float32)`` from
    the scores' gradient ``da [NT, HV, C, C]``, the states ``hs`` and their gradients ``dhe`` (``chunk_dqk_intra``,
    then ``chunk_dqk_inter``). ``gv``: the value side's cumulative gates ``[R, HV, V]`` of a recurrence that decays
    both sides (the states then stored transposed, ``[NT, HV, V, K]``: ``ejkernel_triton._value_chunk``)."""
    from ejkernel_triton import _chunk_kernels as kern
    from ejkernel_triton import launch

    r, h, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    f32 = jnp.float32
    common: dict[str, Any] = {"num_warps": plan.num_warps, "num_stages": plan.num_stages}
    sizes: dict[str, Any] = {"HV": hv, "BT": plan.chunk, **_dots(q.dtype)}
    per_head = jax.ShapeDtypeStruct((r, hv, dk), f32)
    # key tiles of at most 32 for float32 dots (three tf32 passes), as timed (_block_launch)
    dot = _DOT[np.dtype(q.dtype).name]
    bk_intra = min(plan.block_k, 32) if dot == "fp32" else plan.block_k
    blocks = _block_launch(plan, dot, "dqk")
    dqi, dki = launch.launch(
        kern.chunk_dqk_intra,
        q,
        k,
        gc,
        da,
        tab.cu,
        tab.seq,
        tab.off,
        out_shape=(per_head, per_head),
        grid=(tab.nt * (plan.chunk // blocks["BC"]) * cdiv(dk, bk_intra), hv),
        name="ejkernel_gla_chunk_dqk_intra",
        H=h,
        DK=dk,
        GK=dk,
        BK=bk_intra,
        **blocks,
        **sizes,
    )
    dq, dk_, dg = launch.launch(
        kern.chunk_dqk_inter,
        q,
        k,
        v,
        gc,
        jnp.asarray(_DUMMY_F32) if gv is None else gv,
        do,
        hs,
        dhe,
        dqi,
        dki,
        da,
        tab.cu,
        tab.seq,
        tab.off,
        float(scale),
        # dq, dk in q's dtype unless grouped value heads sum them afterwards (in float32)
        out_shape=(per_head if hv != h else jax.ShapeDtypeStruct((r, hv, dk), q.dtype),) * 2 + (per_head,),
        grid=(tab.nt * cdiv(dk, plan.block_k), hv),
        zeroed_outputs=tab.zeroed(0, 1, 2),  # tokens outside every sequence get no gradient
        name="ejkernel_gla_chunk_dqk_inter",
        H=h,
        DK=dk,
        DV=dv,
        GK=dk,
        BK=plan.block_k,
        BV=plan.block_v,
        HAS_GV=gv is not None,
        **sizes,
        **common,
    )
    return dq, dk_, dg


# ------------------------------------------------------------------------------------------------
# The differentiable call.
# ------------------------------------------------------------------------------------------------


def _group_sum(x: jax.Array, h: int) -> jax.Array:
    """``[R, HV, K]`` per value head summed over each group of ``HV // h`` value heads: ``[R, h, K]``."""
    r, hv, dk = x.shape
    return x if hv == h else x.reshape(r, h, hv // h, dk).sum(axis=2)


def _forward_dense(s: Static, has_h0: bool, q, k, v, g, h0):  # noqa: ANN001, ANN202
    b, t = q.shape[:2]
    tab = _chunk_table(b, t, s.fwd.chunk, None)
    o, ht, a, gc = _forward_rows(s, tab, _rows(q), _rows(k), _rows(v), _rows(g), h0 if has_h0 else None)
    return o.reshape(v.shape[:3] + (o.shape[-1],)), ht, a.reshape(b, tab.nt // b, *a.shape[1:]), gc.reshape(g.shape)


def _backward_dense(s: Static, has_h0: bool, has_dht: bool, has_a: bool, has_gc: bool, q, k, v, g, h0, do, dht, a):  # noqa: ANN001, ANN202
    b, t, h, dk = q.shape
    tab = _chunk_table(b, t, s.bwd.chunk, None)
    dq, dk_, dv, dg, dh0 = _backward_rows(
        s,
        tab,
        _rows(q),
        _rows(k),
        _rows(v),
        _rows(g),
        h0 if has_h0 else None,
        _rows(do),
        dht if has_dht else None,
        _rows(a) if has_a else None,
        _rows(g) if has_gc else None,
    )
    return (
        _group_sum(dq, h).reshape(q.shape),
        _group_sum(dk_, h).reshape(k.shape),
        dv.reshape(v.shape),
        dg.reshape(g.shape),
        dh0,
    )


def _forward(s: Static, q, k, v, g, h0, cu):  # noqa: ANN001, ANN202
    """``(o, final state, A, cumulative gates)`` (``A [B, NT / B, HV, C, C]`` dense, ``[NT, HV, C, C]`` packed, and
    the gates in ``g``'s shape: the backward's residuals); dense calls fold ``vmap`` into the batch, packed ones run
    once per element."""
    h0_ = jnp.asarray(_DUMMY_F32) if h0 is None else h0.astype(jnp.float32)
    if cu is None:
        run = fold_vmap(
            functools.partial(_forward_dense, s, h0 is not None), (0, 0, 0, 0, 0 if h0 is not None else None), 0
        )
        return run(q, k, v, g, h0_)
    t = q.shape[1]
    tab = _chunk_table(1, t, s.fwd.chunk, cu)
    o, ht, a, gc = _forward_rows(s, tab, q[0], k[0], v[0], g[0], h0_ if h0 is not None else None)
    return o[None], ht, a, gc[None]


def _backward(s: Static, res: tuple[Any, ...], cotangents: tuple[jax.Array, ...]) -> tuple[Any, ...]:
    q, k, v, g, h0, cu, a = res
    do = cotangents[0]
    dht = cotangents[1].astype(jnp.float32) if s.output_final_state else None
    has_h0, has_dht, has_a = h0 is not None, dht is not None, a is not None
    has_gc = _keeps_gates(s, g.dtype)  # then g holds the forward's cumulative gates
    h0_ = jnp.asarray(_DUMMY_F32) if h0 is None else h0.astype(jnp.float32)
    dht_ = jnp.asarray(_DUMMY_F32) if dht is None else dht
    if cu is None:
        run = fold_vmap(
            functools.partial(_backward_dense, s, has_h0, has_dht, has_a, has_gc),
            (0, 0, 0, 0, 0 if has_h0 else None, 0, 0 if has_dht else None, 0 if has_a else None),
            0,
        )
        dq, dk, dv, dg, dh0 = run(q, k, v, g, h0_, do, dht_, a if has_a else jnp.asarray(_DUMMY_F32))
    else:
        b, t, h, _ = q.shape
        tab = _chunk_table(1, t, s.bwd.chunk, cu)
        dq, dk, dv, dg, dh0 = _backward_rows(
            s,
            tab,
            q[0],
            k[0],
            v[0],
            g[0],
            h0_ if has_h0 else None,
            do[0],
            dht_ if has_dht else None,
            a,
            g[0] if has_gc else None,
        )
        dq, dk = _group_sum(dq, h)[None], _group_sum(dk, h)[None]
        dv, dg = dv[None], dg[None]
    return (
        dq.astype(q.dtype),
        dk.astype(k.dtype),
        dv.astype(v.dtype),
        dg.astype(g.dtype),
        None if h0 is None else dh0.astype(h0.dtype),
        None,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def chunk_gla(
    s: Static,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    h0: jax.Array | None,
    cu: jax.Array | None,
) -> tuple[jax.Array, jax.Array]:
    """``(o, final state)`` by the chunked kernels (forward and backward, module docstring); ``cu`` gets no
    gradient, ``h0`` any float dtype (its gradient has it)."""
    o, final, _, _ = _forward(s, q, k, v, g, h0, cu)
    return o, final


def _keeps_gates(s: Static, g_dtype: Any) -> bool:
    """Whether the residuals hold the forward's cumulative gates in place of float32 gates ``g`` (same size; the
    backward then skips their cumulative sum): when both passes cut the same chunks."""
    return s.bwd.chunk == s.fwd.chunk and np.dtype(g_dtype) == np.float32


def _chunk_gla_fwd(s: Static, q, k, v, g, h0, cu):  # noqa: ANN001, ANN202
    """Residuals: the inputs and, when both passes cut the same chunks, the forward's intra-chunk scores ``A``
    (the backward needs them too; ``(T / C) * HV * C * C`` per batch row, bfloat16 for bfloat16 inputs) and its
    cumulative gates in place of float32 ``g`` (:func:`_keeps_gates`)."""
    o, final, a, gc = _forward(s, q, k, v, g, h0, cu)
    same = s.bwd.chunk == s.fwd.chunk
    return (o, final), (q, k, v, gc if _keeps_gates(s, g.dtype) else g, h0, cu, a if same else None)


chunk_gla.defvjp(_chunk_gla_fwd, _backward)


def gla(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    cu_seqlens: jax.Array | None = None,
    fwd_params: ChunkFwdParams | None = None,
    bwd_params: ChunkBwdParams | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Gated linear attention (contract: ``ejkernel.modules.operations.gla``) by the chunked Triton kernels.

    Shapes: ``q``, ``k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g [B, T, HV, K]``, ``initial_state
    [B or N, HV, K, V]``, ``cu_seqlens [N + 1]``; returns ``(o [B, T, HV, V] in q's dtype, final state float32
    or None)``."""
    fp = coerce(ChunkFwdParams, fwd_params) or ChunkFwdParams()
    bp = coerce(ChunkBwdParams, bwd_params) or ChunkBwdParams()
    q, k, v, g = (jnp.asarray(x) for x in (q, k, v, g))
    h0 = None if initial_state is None else jnp.asarray(initial_state)
    cu = None if cu_seqlens is None else jnp.asarray(cu_seqlens)
    d = Dims(int(q.shape[-1]), int(v.shape[-1]), _n_states(q, v, cu))
    s = Static(
        make_plan(d, fp, "fwd"),
        make_plan(d, bp, "bwd"),
        float(d.dk**-0.5 if scale is None else scale),
        bool(output_final_state),
    )
    o, final = chunk_gla(s, q, k, v, g, h0, cu)
    return o, (final if output_final_state else None)
