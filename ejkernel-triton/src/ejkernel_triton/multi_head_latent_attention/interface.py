"""Triton ``multi_head_latent_attention`` for decoding: split-K (flash-decoding) over the context with a log-sum-exp
merge; the kernel is ``ejkernel_triton._mla_kernels`` (its docstring lays out the program and the layouts).

Shapes: B batch, T query length, H query heads, Dl latent (value) dim, Dr rotary dim, D = Dl + Dr; R = T * H query
rows of a sequence (the heads and the few queries of a decode step, packed as the rows of one tile); paged: P cache
pages of ``page`` tokens, maxp pages per sequence.

All the query rows of a sequence attend the same latent per key, so a program takes ``block_rows`` of them against
each key tile, loaded once; ``block_dv`` below Dl deals the value dims out to several programs (each recomputes
the scores and holds a ``[block_rows, block_dv]`` float32 accumulator: fewer registers for more score work). With
few rows (16 heads: DeepSeek-V3's 128 over 8 GPUs) a tile of them is below a wgmma's 64 rows, so the kernel's
transposed form (``MlaDecodeParams.transposed``) puts the keys in the dots' rows instead. The context is cut into ``num_splits`` runs of key blocks so that every SM has work: at batch 1 the sequence's few
row blocks alone would leave an H200's 132 SMs idle; at batch 64 fewer splits are needed (:func:`num_splits`).

Launch parameters: :class:`MlaDecodeParams` (None fields: :func:`heuristic_cfg`'s); the backward has none
(:class:`MlaBwdParams`).

Declined (``supports``): more than :data:`MAX_QUERY_LEN` queries per sequence (prefill: the XLA implementation's
blockwise kernel, whose query tiles pay off there), Dl above 512 or Dr above 128 (the query tile and the float32
accumulator would not fit in registers), dtypes other than float32, bfloat16 and float16.

Gradients: the kernel is forward only. :func:`mla_decode` is a ``jax.custom_vjp`` whose backward is the VJP of the
core's reference (``ejkernel.testing.reference.multi_head_latent_attention``), always installed with the core.
Its cost: the backward recomputes the attention densely in XLA in float32, with the ``[B, H, T, S]`` scores and
probabilities held for the reverse pass (S the cache's capacity, ``maxp * page`` when paged) and a paged cache
gathered to ``[B, maxp * page, D]``; between the forward and the backward only the inputs are held. Fine for the
few queries of a decode step; training goes to the XLA implementation (above this one in priority).

Under ``jit`` (unchecked metadata) lengths are clamped into ``[0, maxp * page]`` and table entries into ``[0, P)``,
as the XLA implementation does: no value makes the kernel read outside the cache.

Importing this module does not import Triton (the registrations and the params classes need it light).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.device import cdiv, first_gpu, fold_vmap, next_power_of_2, shared_memory_per_block
from ejkernel.kernels.params import MappedParams, check_positive, coerce
from ejkernel.modules.operations.multi_head_latent_attention import resolve_latent_dim

from ejkernel_triton._decode import arguments, interpreting, merge_splits

__all__ = [
    "MAX_QUERY_LEN",
    "Dims",
    "MlaBwdParams",
    "MlaDecodeParams",
    "Plan",
    "Static",
    "candidate_cfgs",
    "candidate_plans",
    "default_plan",
    "heuristic_cfg",
    "make_plan",
    "mla_decode",
    "multi_head_latent_attention",
    "num_splits",
    "supports",
]

OP = "multi_head_latent_attention"
#: The most queries per sequence served (a decode step, speculative tokens); more: prefill, the XLA kernel's job.
MAX_QUERY_LEN = 16
_MAX_LATENT_DIM = 512
_MAX_ROPE_DIM = 128
_DTYPES = ("float32", "bfloat16", "float16")
_DEFAULT_SMS = 132  # an H200's, what the heuristics target where no GPU is visible
# The heuristic's DeepSeek program (8 warps, 232 registers a thread, 176 KiB of shared memory on sm_90) is alone on
# its SM; two per SM make two waves, which even out sequences of different lengths.
_PROGRAMS_PER_SM = 2
_MIN_BLOCKS_PER_SPLIT = 2  # below this a split's fixed cost (the query load, its share of the merge) dominates
_MAX_SPLITS = 64
# Half precision: the float32 accumulator a program holds (64 x 256: 64 registers a thread with 8 warps, beside
# the query operand and the score tile). float32 inputs run FMA dots, whose operands sit in registers too: smaller.
_ACC_ELEMENTS = {2: 64 * 512, 4: 16 * 128}


@dataclasses.dataclass(frozen=True)
class MlaDecodeParams(MappedParams):
    """Launch parameters of the Triton ``multi_head_latent_attention``.

    ``block_rows``: query rows (heads x queries) per program, a power of two from 16 to 128; ``block_n``: keys per
    tile, a power of two from 16 to 256; ``block_dv``: value (latent) dims a program accumulates, a power of two
    from 16 to 1024 (Dl or more: all of them, one value block); ``num_splits``: splits of each sequence's context
    (0 or None: chosen from the batch, row blocks, context and SM count); ``num_warps`` (a power of two up to 16),
    ``num_stages`` (software pipelining of the key loop, 1 to 8); ``transposed``: the kernel's transposed form
    (scores as ``K Q^T``, the keys in the dots' rows: for few query rows; one value block, so ``block_dv`` must be
    None or cover Dl). None: the heuristic's. Generic ``kv_blocksize``, ``num_warps`` and ``num_stages`` map to
    them.

    >>> MlaDecodeParams(block_rows=24)
    Traceback (most recent call last):
    ValueError: MlaDecodeParams.block_rows must be a power of two from 16 to 128 or None, got 24
    """

    GENERIC: ClassVar[dict[str, str]] = {
        "kv_blocksize": "block_n",
        "num_warps": "num_warps",
        "num_stages": "num_stages",
    }
    block_rows: int | None = None
    block_n: int | None = None
    block_dv: int | None = None
    num_splits: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    transposed: bool | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.transposed is not None and not isinstance(self.transposed, bool):
            raise ValueError(f"MlaDecodeParams.transposed must be a bool or None, got {self.transposed!r}")
        check_positive(self, "block_rows", power_of_two=True, within=(16, 128))
        check_positive(self, "block_n", power_of_two=True, within=(16, 256))
        check_positive(self, "block_dv", power_of_two=True, within=(16, 1024))
        if self.num_splits != 0 or isinstance(self.num_splits, bool):
            check_positive(self, "num_splits", what=" (0 = auto)")
        check_positive(self, "num_warps", power_of_two=True, within=(1, 16))
        check_positive(self, "num_stages", within=(1, 8))


@dataclasses.dataclass(frozen=True)
class MlaBwdParams(MappedParams):
    """The backward params of the Triton ``multi_head_latent_attention``: none (its backward is the reference's VJP
    in XLA, no Triton launch). Only an empty generic ``BwdParams()`` maps onto it."""


# ------------------------------------------------------------------------------------------------
# Plans: the static launch of one call.
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    """One launch: query rows per program, keys per tile, value dims per program, splits, warps, stages, and
    which form of the kernel (the transposed one takes every value dim)."""

    block_rows: int
    block_n: int
    block_dv: int
    splits: int
    num_warps: int
    num_stages: int
    transposed: bool = False


@dataclasses.dataclass(frozen=True)
class Dims:
    """What the plans depend on: batch, queries, heads, latent and rotary dims, the most keys a sequence can have
    (dense: S; paged: the tables' capacity, lengths being traced), bytes per element."""

    b: int
    t: int
    h: int
    dl: int
    dr: int
    max_keys: int
    e: int

    @property
    def rows(self) -> int:
        return self.t * self.h


def dims_of(invocation: Any) -> Dims:
    args = arguments(invocation)
    q, kv, tables = args["query"], args["kv"], args.get("block_tables")
    b, t, h, d = (int(x) for x in q.shape)
    dl = resolve_latent_dim(args.get("latent_dim"), d)
    keys = int(kv.shape[1]) if tables is None else int(tables.shape[1]) * int(kv.shape[1])
    return Dims(b, t, h, dl, d - dl, keys, int(np.dtype(q.dtype).itemsize))


def _pow2(n: int) -> int:
    """``n`` rounded up to a power of two of at least 16 (the tensor cores' smallest dot dim)."""
    return max(16, next_power_of_2(n))


def _sm_count() -> int:
    gpu = first_gpu()
    return (gpu and gpu.sm_count) or _DEFAULT_SMS


def _smem_limit() -> int:
    gpu = first_gpu()
    return (gpu and gpu.shared_memory_per_block) or shared_memory_per_block((9, 0))


def _smem(d: Dims, block_rows: int, block_n: int, block_dv: int, stages: int) -> int:
    """Shared memory estimate: the query tile once, and per stage the transposed key tile plus, with the value
    dims split, the value slice (with one value block the key tile is the value)."""
    bd = _pow2(d.dl) + (_pow2(d.dr) if d.dr else 0)
    value = block_dv if block_dv < _pow2(d.dl) else 0
    return d.e * (block_rows * bd + stages * block_n * (bd + value))


def _stages(d: Dims, block_rows: int, block_n: int, block_dv: int, want: int) -> int:
    stages = want
    while stages > 1 and _smem(d, block_rows, block_n, block_dv, stages) > _smem_limit():
        stages -= 1
    return stages


def num_splits(d: Dims, block_rows: int, block_dv: int, block_n: int, sms: int | None = None) -> int:
    """Splits of each sequence so that ``B * row blocks * value blocks * splits`` programs fill the device (about
    ``_PROGRAMS_PER_SM`` per SM), each split keeping at least ``_MIN_BLOCKS_PER_SPLIT`` key tiles of the longest
    possible sequence.

    >>> ds = lambda b: Dims(b, 1, 128, 512, 64, 4096, 2)  # DeepSeek-V3 decoding, a 4096-token cache
    >>> num_splits(ds(1), 64, 256, 32, sms=132), num_splits(ds(64), 64, 256, 32, sms=132)
    (64, 2)
    """
    programs = d.b * cdiv(d.rows, block_rows) * cdiv(d.dl, block_dv)
    want = cdiv(_PROGRAMS_PER_SM * (sms or _sm_count()), max(programs, 1))
    most = max(1, cdiv(d.max_keys, block_n) // _MIN_BLOCKS_PER_SPLIT)
    return int(max(1, min(want, most, _MAX_SPLITS)))


def default_plan(d: Dims) -> Plan:
    """The heuristic on Hopper. Half precision, more than 16 query rows: up to 64 rows (a wgmma's M), one value
    block up to Dl = 512 (the scores computed once; a 64 x 512 float32 accumulator is 128 registers a thread over 8
    warps), 64-key tiles 2 deep (the query tile and two 64 x 576 key tiles: 216 KB of shared memory). 16 rows or
    fewer (16 heads, e.g. DeepSeek-V3's 128 over 8 GPUs): the transposed form, 16 rows, 64-key tiles 2 deep, 4
    warps. Timed on the H200 at DeepSeek-V3's dims, B64 x 4096, 2026-12-04 (``benchmarks/gpucheck/mla_variants.py``,
    its own timer): with 128 heads 0.45 ms against 0.63-0.77 with one stage and 1.12-1.19 for the first default (two
    value blocks of 256, 32-key tiles); with 16 heads the transposed form 0.23 ms against 0.33-0.35. float32: 16
    rows, 16 keys, 128 value dims (FMA dots hold their operands in registers). In Triton's interpreter: one value
    block, 16-key tiles, 2 splits (small and quick, still exercising the merge)."""
    bdl, rows = _pow2(d.dl), _pow2(d.rows)
    if interpreting():
        return Plan(min(64, rows), 16, bdl, 2, 4, 1)
    if d.e < 4 and rows <= 16:
        return Plan(16, 64, bdl, num_splits(d, 16, bdl, 64), 4, _stages(d, 16, 64, bdl, 2), True)
    if d.e < 4:
        block_rows = min(64, rows)
        block_dv = min(bdl, max(16, _ACC_ELEMENTS[2] // block_rows))
        block_n = 64
    else:
        block_rows, block_dv, block_n = 16, min(bdl, 128), 16
    warps = 8 if block_rows * block_dv >= _ACC_ELEMENTS[2] or bdl >= 256 else 4
    stages = _stages(d, block_rows, block_n, block_dv, 2)
    return Plan(block_rows, block_n, block_dv, num_splits(d, block_rows, block_dv, block_n), warps, stages)


def make_plan(d: Dims, p: MlaDecodeParams) -> Plan:
    """The plan of a call: ``p``'s fields, the others the heuristic's (rows and value dims are used up to the
    call's rows and Dl rounded up to powers of two; splits follow the blocks when not given)."""
    base = default_plan(d)
    bdl = _pow2(d.dl)
    transposed = base.transposed if p.transposed is None else p.transposed
    block_rows = min(p.block_rows or base.block_rows, _pow2(d.rows))
    block_dv = min(p.block_dv or base.block_dv, bdl)
    if transposed:
        if p.block_dv is not None and p.block_dv < bdl:
            raise ValueError(
                f"{OP}: MlaDecodeParams.transposed takes every value dim in one block: block_dv must be None or at "
                f"least {bdl}, got {p.block_dv}"
            )
        block_dv = bdl
    block_n = p.block_n or base.block_n
    same = (block_rows, block_n, block_dv, transposed) == (
        base.block_rows,
        base.block_n,
        base.block_dv,
        base.transposed,
    )
    splits = p.num_splits or (base.splits if same or interpreting() else num_splits(d, block_rows, block_dv, block_n))
    stages = p.num_stages or (base.num_stages if same else _stages(d, block_rows, block_n, block_dv, 2))
    warps = int(p.num_warps or base.num_warps)
    return Plan(block_rows, block_n, block_dv, int(splits), warps, int(stages), transposed)


def params_of(plan: Plan) -> MlaDecodeParams:
    return MlaDecodeParams(
        block_rows=plan.block_rows,
        block_n=plan.block_n,
        block_dv=plan.block_dv,
        num_splits=plan.splits,
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
        transposed=plan.transposed,
    )


# (rows, keys per tile, value dims, warps, stages, transposed) around the heuristic (times: the H200 at DeepSeek-V3's
# dims, 2026-12-04, benchmarks/results/2026-12-04-h200-mla-variants*.log): 64-key tiles 1 deep (0.63-0.77 ms with 128
# heads against the default's 0.45), 32-key tiles 2 deep, 16-key tiles 3 deep, the first default (two value blocks of
# 256: 1.12-1.19 ms), narrow value blocks with 4 warps, 32 rows (below a wgmma's 64: mma.sync), and the transposed
# form with 16 rows (0.23 ms with 16 heads against the split form's 0.33-0.35; 0.9 ms with 128) and 64 rows.
_GPU_SHAPES = (
    (64, 64, 1024, 8, 1, False),
    (64, 32, 1024, 8, 2, False),
    (64, 16, 1024, 8, 3, False),
    (64, 32, 256, 8, 2, False),
    (64, 32, 128, 4, 2, False),
    (32, 32, 1024, 8, 2, False),
    (64, 64, 1024, 8, 2, False),
    (16, 64, 1024, 4, 2, True),
    (16, 32, 1024, 4, 4, True),
    (64, 64, 1024, 8, 2, True),
)


def candidate_plans(d: Dims) -> list[Plan]:
    """Plans worth timing, the heuristic's first; then the shapes of ``_GPU_SHAPES`` (clipped to the call's rows
    and Dl), each with its own split count and the stages shared memory allows, and the heuristic's with twice and
    half its splits. In the interpreter: three more, small (several row and value blocks, 3 splits; one split; the
    transposed form)."""
    base = default_plan(d)
    out = [base]
    bdl, rows = _pow2(d.dl), _pow2(d.rows)
    if interpreting():
        out += [Plan(16, 32, max(16, bdl // 2), 3, 4, 1), Plan(16, 16, bdl, 1, 4, 1), Plan(16, 16, bdl, 3, 4, 1, True)]
    elif d.e < 4:
        for r, n, dv, warps, stages, transposed in _GPU_SHAPES:
            r, dv = min(r, rows), min(dv, bdl)
            plan = Plan(r, n, dv, num_splits(d, r, dv, n), warps, _stages(d, r, n, dv, stages), transposed)
            out.append(plan)
        for splits in (base.splits * 2, base.splits // 2):
            if 1 <= splits <= _MAX_SPLITS:
                out.append(dataclasses.replace(base, splits=splits))
    return list(dict.fromkeys(out))


def heuristic_cfg(inv: Any, stage: str = "fwd") -> MlaDecodeParams | MlaBwdParams:
    if stage != "fwd":
        return MlaBwdParams()  # the backward is the reference's VJP: nothing to tune
    return params_of(default_plan(dims_of(inv)))


def candidate_cfgs(inv: Any, stage: str = "fwd") -> list[MlaDecodeParams] | list[MlaBwdParams]:
    if stage != "fwd":
        return [MlaBwdParams()]
    return [params_of(p) for p in candidate_plans(dims_of(inv))]


def supports(inv: Any) -> str | None:
    """None when the decode kernel serves the call, else why not (see the module docstring)."""
    args = arguments(inv)
    q, kv = args["query"], args["kv"]
    for name, x in (("query", q), ("kv", kv)):
        dt = np.dtype(x.dtype)
        if dt.name not in _DTYPES:
            return f"ejkernel-triton {OP}: {name} dtype {dt.name} is not supported ({', '.join(_DTYPES)})"
    d = dims_of(inv)
    if d.t > MAX_QUERY_LEN:
        return (
            f"ejkernel-triton {OP}: T={d.t} queries per sequence > {MAX_QUERY_LEN}: the Triton kernel is for decoding; "
            "prefill is the XLA implementation's"
        )
    if d.dl > _MAX_LATENT_DIM or d.dr > _MAX_ROPE_DIM:
        return (
            f"ejkernel-triton {OP}: latent dims up to {_MAX_LATENT_DIM} and rotary dims up to {_MAX_ROPE_DIM} are "
            f"supported (the query tile and accumulator live in registers), got Dl={d.dl}, Dr={d.dr}"
        )
    if importlib.util.find_spec("triton") is None:  # find, don't import: see ejkernel_triton.launch
        return f"ejkernel-triton {OP}: triton is not installed"
    return None


# ------------------------------------------------------------------------------------------------
# The launch, the merge and the differentiable wrapper.
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Static:
    """Everything static about one call: the custom_vjp's non-differentiable argument."""

    plan: Plan
    latent_dim: int
    scale: float
    causal: bool


_DUMMY_TABLE = np.zeros((1, 1), np.int32)  # the dense kernel reads no table


def _launch(s: Static, paged: bool, q: jax.Array, kv: jax.Array, lens: jax.Array, tables: jax.Array) -> jax.Array:
    """``out [B, T, H, Dl]`` of one launch and its merge (``lens`` already clamped into the cache)."""
    from ejkernel_triton import _mla_kernels as kern
    from ejkernel_triton import launch

    b, t, h, d = q.shape
    r, dl, plan = t * h, s.latent_dim, s.plan
    num_pages, page = (kv.shape[0], kv.shape[1]) if paged else (1, 1)
    value_block: dict[str, Any] = {}
    if plan.transposed:  # one value block: the grid's first axis is the row blocks alone
        kernel, grid = kern.mla_decode_fwd_t, cdiv(r, plan.block_rows)
    else:
        kernel, grid = kern.mla_decode_fwd, cdiv(r, plan.block_rows) * cdiv(dl, plan.block_dv)
        value_block["BLOCK_DV"] = plan.block_dv
    o, lse = launch.launch(
        kernel,
        q,
        kv,
        lens,
        tables,
        float(s.scale),
        int(tables.shape[1]),
        int(kv.shape[1]),
        int(num_pages),
        out_shape=(
            jax.ShapeDtypeStruct((b, plan.splits, r, dl), jnp.float32),
            jax.ShapeDtypeStruct((b, plan.splits, r), jnp.float32),
        ),
        grid=(grid, plan.splits, b),
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
        name="ejkernel_mla_decode",
        T=t,
        H=h,
        DL=dl,
        DR=d - dl,
        BLOCK_R=plan.block_rows,
        BLOCK_DL=_pow2(dl),
        BLOCK_DR=_pow2(d - dl),
        BLOCK_N=plan.block_n,
        PAGE=int(page),
        PAGED=paged,
        CAUSAL=s.causal,
        NUM_SPLITS=plan.splits,
        **value_block,
    )
    return merge_splits(o, lse, q.dtype).reshape(b, t, h, dl)


def _dense(s: Static, q: jax.Array, kv: jax.Array) -> jax.Array:
    lens = jnp.full((q.shape[0],), kv.shape[1], jnp.int32)
    return _launch(s, False, q, kv, lens, jnp.asarray(_DUMMY_TABLE))


def _forward(s: Static, q: jax.Array, kv: jax.Array, lens: jax.Array | None, tables: jax.Array | None) -> jax.Array:
    """The kernel's output. Under ``jax.vmap`` one launch over the folded batch: a dense ``kv`` folds with the
    queries, a paged cache is shared (a mapped one runs once per element: ``fold_vmap``'s sequential rule)."""
    if tables is None:
        return fold_vmap(functools.partial(_dense, s), (0, 0), 0)(q, kv)
    assert lens is not None
    return fold_vmap(functools.partial(_launch, s, True), (0, None, 0, 0), 0)(q, kv, lens, tables)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def mla_decode(s: Static, q: jax.Array, kv: jax.Array, lens: jax.Array | None, tables: jax.Array | None) -> jax.Array:
    """``[B, T, H, Dl]``: the split-K kernel forward, the reference's VJP backward (module docstring). Dense when
    ``tables`` is None; ``lens`` (clamped) and ``tables`` get no gradient."""
    return _forward(s, q, kv, lens, tables)


def _mla_decode_fwd(
    s: Static, q: jax.Array, kv: jax.Array, lens: jax.Array | None, tables: jax.Array | None
) -> tuple[jax.Array, tuple[Any, ...]]:
    return _forward(s, q, kv, lens, tables), (q, kv, lens, tables)


def _mla_decode_bwd(s: Static, res: tuple[Any, ...], g: jax.Array) -> tuple[Any, ...]:
    from ejkernel.testing.reference.multi_head_latent_attention import multi_head_latent_attention as reference

    q, kv, lens, tables = res
    fn = functools.partial(
        reference,
        latent_dim=s.latent_dim,
        softmax_scale=s.scale,
        causal=s.causal,
        block_tables=tables,
        cache_seqlens=lens,
    )
    _, vjp = jax.vjp(fn, q, kv)
    dq, dkv = vjp(g)
    return dq, dkv, None, None


mla_decode.defvjp(_mla_decode_fwd, _mla_decode_bwd)


def multi_head_latent_attention(
    query: jax.Array,
    kv: jax.Array,
    *,
    latent_dim: int | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    block_tables: jax.Array | None = None,
    cache_seqlens: jax.Array | None = None,
    fwd_params: MlaDecodeParams | None = None,
    bwd_params: MlaBwdParams | None = None,
) -> jax.Array:
    """Multi-head latent attention (contract: ``ejkernel.modules.operations.multi_head_latent_attention``) by the
    split-K decode kernel.

    Shapes: ``query [B, T, H, D]``; ``kv`` dense ``[B, S, D]`` or a paged cache ``[P, page, D]`` with
    ``block_tables [B, maxp]`` and ``cache_seqlens [B]``; returns ``[B, T, H, Dl]`` in ``query``'s dtype."""
    p = coerce(MlaDecodeParams, fwd_params) or MlaDecodeParams()
    coerce(MlaBwdParams, bwd_params)  # checked: a wrong class is an error, never ignored
    query, kv = jnp.asarray(query), jnp.asarray(kv)
    b, t, h, d = query.shape
    dl = resolve_latent_dim(latent_dim, d)
    if (block_tables is None) != (cache_seqlens is None):
        raise ValueError(f"{OP}: the paged variant needs both block_tables and cache_seqlens")
    capacity = kv.shape[1] if block_tables is None else block_tables.shape[1] * kv.shape[1]
    if 0 in (b, t, h, capacity) or (block_tables is not None and kv.shape[0] == 0):
        return jnp.zeros((b, t, h, dl), query.dtype)  # no keys (or no queries): nothing to attend
    e = int(np.dtype(query.dtype).itemsize)
    plan = make_plan(Dims(b, t, h, dl, d - dl, int(capacity), e), p)
    s = Static(plan, dl, float(d**-0.5 if softmax_scale is None else softmax_scale), bool(causal))
    if block_tables is None:
        return mla_decode(s, query, kv, None, None)
    lens = jnp.clip(jnp.asarray(cache_seqlens).astype(jnp.int32), 0, capacity)
    return mla_decode(s, query, kv, lens, jnp.asarray(block_tables).astype(jnp.int32))
