"""What the Triton ``gla`` and ``gated_delta_rule`` share: launch parameters, plans, ``supports``, the launch and
the differentiable wrapper around the fused recurrent kernel (``ejkernel_triton._recurrent_kernels``).

These implementations are for decoding: one or a few tokens per sequence against a float32 state
``[B or N, HV, K, V]``, which the kernel reads once and writes once. Long sequences are the chunked kernels'
job (a token-by-token loop has no parallelism along T): :func:`supports_recurrent` declines a mean sequence
length above :data:`MAX_DECODE_LENGTH`.

Gradients: the kernel is forward only. :func:`fused_recurrent` is a ``jax.custom_vjp`` whose backward is the
VJP of the core's reference recurrence (``ejkernel.testing.reference``), always installed with the core. Its
cost: the backward recomputes the forward with the reference's token-by-token ``lax.scan`` in XLA and keeps
every step's state for the reverse pass, i.e. ``T * (B or N) * HV * K * V`` float32 of memory and ``2 T``
sequential steps; between the forward and the backward only the inputs are held. Fine for the short
sequences served here; training goes to the chunked XLA implementation (above this one in priority).

Importing this module does not import Triton (the registrations and the params classes need it light).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.device import cdiv, first_gpu, fold_vmap, next_power_of_2
from ejkernel.kernels.params import MappedParams, check_positive

from ejkernel_triton._decode import interpreting

__all__ = [
    "MAX_DECODE_LENGTH",
    "Dims",
    "NoBwdParams",
    "Plan",
    "RecurrentParams",
    "Static",
    "candidate_plans",
    "decode_reason",
    "default_plan",
    "dims_of",
    "fused_recurrent",
    "is_decode",
    "make_plan",
    "params_of",
    "supports_recurrent",
]

#: The longest mean sequence length served (T, or T / N with packed sequences); longer: the chunked kernels.
MAX_DECODE_LENGTH = 32  # speculative decoding verifies a few tokens per step; prefill is the chunked kernels
_MAX_HEAD_DIM = 256
_DTYPES = ("float32", "bfloat16", "float16")
_DEFAULT_SMS = 132  # an H200's, what the heuristics target where no GPU is visible
_STATE_TILE = 4096  # float32 state elements per program (K x BV): 32 registers a thread with 4 warps
_MIN_BLOCK_V = 8


@dataclasses.dataclass(frozen=True)
class RecurrentParams(MappedParams):
    """Launch parameters of the Triton fused recurrent ``gla``/``gated_delta_rule``.

    ``block_v``: value channels per program (a power of two from 1 to 256; the program holds a ``[K, block_v]``
    float32 state tile, ``K`` rounded up to a power of two); ``num_warps`` (a power of two up to 16),
    ``num_stages`` (software pipelining of the token loop, 1 to 8). None: the heuristic's. Generic
    ``num_warps``/``num_stages`` map to them.

    >>> RecurrentParams(block_v=24)
    Traceback (most recent call last):
    ValueError: RecurrentParams.block_v must be a power of two from 1 to 256 or None, got 24
    """

    GENERIC: ClassVar[dict[str, str]] = {"num_warps": "num_warps", "num_stages": "num_stages"}
    block_v: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(self, "block_v", power_of_two=True, within=(1, _MAX_HEAD_DIM))
        check_positive(self, "num_warps", power_of_two=True, within=(1, 16))
        check_positive(self, "num_stages", within=(1, 8))


@dataclasses.dataclass(frozen=True)
class NoBwdParams(MappedParams):
    """The backward params of the Triton ``gla``/``gated_delta_rule``: none (their backward is the reference's
    VJP in XLA, no Triton launch). Only an empty generic ``BwdParams()`` maps onto it."""


# ------------------------------------------------------------------------------------------------
# Plans: the static launch of one call.
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    """One launch: value channels per program (a power of two), warps, stages."""

    block_v: int
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class Dims:
    """What the plans depend on: sequences (B or N), value heads, head dims."""

    n: int
    hv: int
    dk: int
    dv: int


def arguments(invocation: Any) -> Mapping[str, Any]:
    args = getattr(invocation, "arguments", invocation)
    if not isinstance(args, Mapping):
        raise TypeError(f"expected an invocation with an .arguments mapping, got {type(invocation).__name__}")
    return args


def dims_of(invocation: Any) -> Dims:
    args = arguments(invocation)
    q, v, cu = args["q"], args["v"], args.get("cu_seqlens")
    n = int(q.shape[0]) if cu is None else int(cu.shape[0]) - 1
    return Dims(n, int(v.shape[2]), int(q.shape[-1]), int(v.shape[-1]))


def _sm_count() -> int:
    gpu = first_gpu()
    return (gpu and gpu.sm_count) or _DEFAULT_SMS


def _pow2(n: int) -> int:
    return max(1, next_power_of_2(n))


def _warps(tile: int) -> int:
    """Warps for a ``tile``-element state: about 32 elements a thread, from 1 to 8 warps."""
    return int(min(8, max(1, tile // (32 * 32))))


def default_plan(d: Dims) -> Plan:
    """The heuristic: a ``[K, BV]`` state tile of about :data:`_STATE_TILE` elements (``K = 128``: 32 value
    channels), halved (down to 8 channels) while the launch has fewer than two programs per SM; 2 stages.
    In Triton's interpreter: all the value channels in one program (fewer, quicker programs)."""
    bk, bv_all = _pow2(d.dk), _pow2(d.dv)
    if interpreting():
        return Plan(bv_all, 4, 1)
    bv = min(bv_all, max(_MIN_BLOCK_V, _STATE_TILE // bk))
    while bv > _MIN_BLOCK_V and d.n * d.hv * cdiv(d.dv, bv) < 2 * _sm_count():
        bv //= 2
    return Plan(bv, _warps(bk * bv), 2)


def make_plan(d: Dims, p: RecurrentParams) -> Plan:
    """The plan of a call: ``p``'s fields, the others the heuristic's (a ``block_v`` is used up to ``V``
    rounded up to a power of two)."""
    base = default_plan(d)
    bv = min(p.block_v or base.block_v, _pow2(d.dv))
    warps = p.num_warps or (base.num_warps if p.block_v is None else _warps(_pow2(d.dk) * bv))
    return Plan(int(bv), int(warps), int(p.num_stages or base.num_stages))


def params_of(plan: Plan) -> RecurrentParams:
    return RecurrentParams(block_v=plan.block_v, num_warps=plan.num_warps, num_stages=plan.num_stages)


def candidate_plans(d: Dims) -> list[Plan]:
    """Plans worth timing, the heuristic's first: value blocks from 8 to 128 channels (at most ``V``), each with
    the warps that give it 16 to 64 state elements a thread (one warp for a smaller tile), 2 stages (``K = V = 128``: 11 plans)."""
    base = default_plan(d)
    out = [base]
    bk, bv_all = _pow2(d.dk), _pow2(d.dv)
    if interpreting():  # small and quick: one other split of V
        if bv_all > 1:
            out.append(Plan(bv_all // 2, 4, 1))
        return out
    for bv in (8, 16, 32, 64, 128):
        if bv > bv_all:
            break
        for warps in (1, 2, 4, 8):
            per_thread = bk * bv // (32 * warps)
            plan = Plan(bv, warps, 2)
            if (16 <= per_thread <= 64 or (warps == 1 and per_thread < 16)) and plan not in out:
                out.append(plan)
    return out


# ------------------------------------------------------------------------------------------------
# supports.
# ------------------------------------------------------------------------------------------------


def lengths_over_decode(invocation: Any) -> str:
    """The call's length against :data:`MAX_DECODE_LENGTH`, for messages: ``T=80 > 32`` or ``T=300 tokens in 4
    packed sequences (mean length > 32)``."""
    args = arguments(invocation)
    t, cu = int(args["q"].shape[1]), args.get("cu_seqlens")
    if cu is None:
        return f"T={t} > {MAX_DECODE_LENGTH}"
    return f"T={t} tokens in {max(1, int(cu.shape[0]) - 1)} packed sequences (mean length > {MAX_DECODE_LENGTH})"


def is_decode(invocation: Any) -> bool:
    """Whether a call is decode steps: sequences of :data:`MAX_DECODE_LENGTH` tokens or fewer (on average, when
    packed)."""
    args = arguments(invocation)
    t, cu = int(args["q"].shape[1]), args.get("cu_seqlens")
    n = 1 if cu is None else max(1, int(cu.shape[0]) - 1)
    return t <= MAX_DECODE_LENGTH * n


def decode_reason(op: str, invocation: Any) -> str | None:
    """Why the chunked ``lightning_attn`` and ``recurrent`` decline a call on a GPU: decode steps, where XLA's
    implementation (which fuses the scalar decay into its state update) is faster than the chunked kernels and
    gla's fused recurrent kernel (plugin.py). None in Triton's interpreter, which checks the kernels at any length."""
    if is_decode(invocation) and not interpreting():
        return f"ejkernel-triton {op} (chunked): decode steps (T <= {MAX_DECODE_LENGTH} a sequence) are XLA's job"
    return None


def supports_recurrent(op: str, invocation: Any, gates: tuple[str, ...]) -> str | None:
    """None when the fused recurrent kernel serves the call, else why not: dtypes other than float32, bfloat16
    and float16, head dims above 256, or a mean sequence length above :data:`MAX_DECODE_LENGTH`."""
    args = arguments(invocation)
    q, v = args["q"], args["v"]
    for name in ("q", *gates, "initial_state"):
        x = args.get(name)
        if x is None:
            continue
        dt = np.dtype(x.dtype)
        if dt.name not in _DTYPES:
            return f"ejkernel-triton {op}: {name} dtype {dt.name} is not supported ({', '.join(_DTYPES)})"
    dk, dv = int(q.shape[-1]), int(v.shape[-1])
    if not (1 <= dk <= _MAX_HEAD_DIM and 1 <= dv <= _MAX_HEAD_DIM):
        return f"ejkernel-triton {op}: head dims from 1 to {_MAX_HEAD_DIM} are supported, got K={dk}, V={dv}"
    if not is_decode(invocation):
        return (
            f"ejkernel-triton {op}: {lengths_over_decode(invocation)}: the fused recurrent kernel is for decoding; "
            "long sequences are the chunked kernels' job"
        )
    if importlib.util.find_spec("triton") is None:  # find, don't import: see ejkernel_triton.launch
        return f"ejkernel-triton {op}: triton is not installed"
    return None


# ------------------------------------------------------------------------------------------------
# The launch.
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Static:
    """Everything static about one call: the custom_vjp's non-differentiable argument."""

    delta: bool  # gated_delta_rule (else gla)
    plan: Plan
    scale: float
    output_final_state: bool
    use_qk_l2norm: bool = False


_DUMMY_F32 = np.zeros((1,), np.float32)  # stands for an absent beta / initial state
_DUMMY_I32 = np.zeros((1,), np.int32)  # stands for absent cu_seqlens


def _launch(
    s: Static,
    has_gv: bool,
    has_h0: bool,
    varlen: bool,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    gv: jax.Array,
    beta: jax.Array,
    h0: jax.Array,
    cu: jax.Array,
) -> tuple[jax.Array, ...]:
    """``(o,)`` or ``(o, final state)`` of one launch (arrays as the kernel module's docstring lays them out)."""
    from ejkernel_triton import _recurrent_kernels as kern
    from ejkernel_triton import launch

    b, t, h, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    n = cu.shape[0] - 1 if varlen else b
    state_shape = (n, hv, dk, dv) if s.output_final_state else (1,)
    outs = launch.launch(
        kern.fused_recurrent_fwd,
        q,
        k,
        v,
        g,
        gv,
        beta,
        h0,
        cu,
        float(s.scale),
        int(t),
        out_shape=(
            jax.ShapeDtypeStruct((b, t, hv, dv), q.dtype),
            jax.ShapeDtypeStruct(state_shape, jnp.float32),
        ),
        grid=(n * hv, cdiv(dv, s.plan.block_v)),
        num_warps=s.plan.num_warps,
        num_stages=s.plan.num_stages,
        zeroed_outputs=(0,) if varlen else (),  # tokens outside every sequence give zeros
        name="ejkernel_fused_recurrent_" + ("gated_delta_rule" if s.delta else "gla"),
        H=h,
        HV=hv,
        DK=dk,
        DV=dv,
        BK=_pow2(dk),
        BV=s.plan.block_v,
        DELTA=s.delta,
        GATE_K=g.ndim == 4,
        GATE_V=has_gv,
        L2NORM=s.use_qk_l2norm,
        HAS_H0=has_h0,
        STORE_FINAL=s.output_final_state,
        VARLEN=varlen,
    )
    return tuple(outs) if s.output_final_state else (outs[0],)


def _forward(
    s: Static,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    gv: jax.Array | None,
    beta: jax.Array | None,
    h0: jax.Array | None,
    cu: jax.Array | None,
) -> tuple[jax.Array, ...]:
    """The kernel's ``(o,)`` or ``(o, final state)``. Under ``jax.vmap`` one launch over the folded batch (dense
    calls); packed sequences run once per element (``launch``'s sequential rule)."""
    has_gv, has_h0, varlen = gv is not None, h0 is not None, cu is not None
    gv_ = jnp.asarray(_DUMMY_F32) if gv is None else gv
    beta_ = jnp.asarray(_DUMMY_F32) if beta is None else beta
    h0_ = jnp.asarray(_DUMMY_F32) if h0 is None else h0.astype(jnp.float32)
    if cu is None:
        run = fold_vmap(
            functools.partial(_launch, s, has_gv, has_h0, False),
            (0, 0, 0, 0, 0 if has_gv else None, None if beta is None else 0, 0 if has_h0 else None, None),
            0,
        )
        return tuple(run(q, k, v, g, gv_, beta_, h0_, jnp.asarray(_DUMMY_I32)))
    cu_ = jnp.clip(cu.astype(jnp.int32), 0, q.shape[1])  # under jit unchecked: never a row outside the call
    return _launch(s, has_gv, has_h0, varlen, q, k, v, g, gv_, beta_, h0_, cu_)


def reference_vjp(s: Any, primals: tuple[Any, ...], cotangents: tuple[jax.Array, ...]) -> tuple[Any, ...]:
    """The backward: the VJP of the core's reference recurrence (see the module docstring for its cost). ``s``: the
    call's :class:`Static` (its ``delta``, ``scale``, ``output_final_state`` and ``use_qk_l2norm``); ``primals``
    ``(q, k, v, g, gv, beta, h0, cu)``."""
    q, k, v, g, gv, beta, h0, cu = primals
    diff = {"q": q, "k": k, "v": v, "g": g, "g_v": gv, "beta": beta, "initial_state": h0}
    diff = {name: x for name, x in diff.items() if x is not None}

    def reference(d: dict[str, jax.Array]) -> tuple[jax.Array, ...]:
        kw: dict[str, Any] = {
            "scale": s.scale,
            "initial_state": d.get("initial_state"),
            "output_final_state": s.output_final_state,
            "cu_seqlens": cu,
        }
        if s.delta:
            from ejkernel.testing.reference.gated_delta_rule import gated_delta_rule

            o, final = gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"], use_qk_l2norm=s.use_qk_l2norm, **kw)
        elif "g_v" in d or d["g"].ndim == 3:  # recurrent's gates (one head count): g per key channel, or per head
            from ejkernel.testing.reference.recurrent import recurrent

            keyed = d["g"].ndim == 4
            g_, g_k = (None, d["g"]) if keyed else (d["g"], None)
            o, final = recurrent(d["q"], d["k"], d["v"], g_, g_k, d.get("g_v"), **kw)
        else:
            from ejkernel.testing.reference.gla import gla

            o, final = gla(d["q"], d["k"], d["v"], d["g"], **kw)
        return (o, final) if final is not None else (o,)

    _, vjp = jax.vjp(reference, diff)
    (grads,) = vjp(cotangents)
    return tuple(
        None if x is None else grads[name]
        for name, x in zip(("q", "k", "v", "g", "g_v", "beta", "initial_state"), primals, strict=False)
    ) + (None,)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fused_recurrent(
    s: Static,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    gv: jax.Array | None,
    beta: jax.Array | None,
    h0: jax.Array | None,
    cu: jax.Array | None,
) -> tuple[jax.Array, ...]:
    """``(o,)``, or ``(o, final state)`` with ``s.output_final_state``: the fused recurrent kernel forward, the
    reference's VJP backward (module docstring). ``g``: ``[B, T, HV, K]``, a log decay per key channel (``gla``),
    or ``[B, T, HV]``, one per token and head (``gated_delta_rule``; ``gla`` for ``lightning_attn`` and
    ``recurrent`` without a key gate); ``beta`` only for ``gated_delta_rule``; ``h0`` any float dtype (its gradient
    has it); ``gv`` (``[B, T, HV, V]``, a log decay of the value channels, ``recurrent``'s ``g_v``) only for
    ``gla``; ``cu`` gets no gradient."""
    return _forward(s, q, k, v, g, gv, beta, h0, cu)


def _fused_recurrent_fwd(
    s: Static,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    gv: jax.Array | None,
    beta: jax.Array | None,
    h0: jax.Array | None,
    cu: jax.Array | None,
) -> tuple[tuple[jax.Array, ...], tuple[Any, ...]]:
    return _forward(s, q, k, v, g, gv, beta, h0, cu), (q, k, v, g, gv, beta, h0, cu)


def _fused_recurrent_bwd(s: Static, res: tuple[Any, ...], cotangents: tuple[jax.Array, ...]) -> tuple[Any, ...]:
    return reference_vjp(s, res, cotangents)


fused_recurrent.defvjp(_fused_recurrent_fwd, _fused_recurrent_bwd)
