"""What the Triton decode implementations share: launch parameters, the split count, the launch and the merge.

``page_attention`` (a paged cache) and ``ragged_decode_attention`` (a dense cache with ragged ranges) are one
problem here: each sequence ``n`` attends the keys ``[lo[n], hi[n])`` of its rows of the cache, with one query
of ``H`` heads. Both run the split-K kernel of ``ejkernel_triton._decode_kernels`` (grid ``(splits, KH, N)``)
and merge its per-split partial outputs by log-sum-exp (:func:`merge_splits`, a jnp epilogue XLA fuses).

The split count makes every SM busy: ``N * KH`` programs are often fewer than the device runs at once (batch 1:
``KH`` programs for 132 SMs), so the context is cut into splits until there are about
``_PROGRAMS_PER_SM`` programs per SM, never leaving a split fewer than ``_MIN_BLOCKS_PER_SPLIT`` key blocks of
the longest sequence the call can hold (the cache's capacity: lengths are traced).

Importing this module does not import Triton (the registrations and the params classes need it light).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.device import cdiv, first_gpu, fold_vmap, next_power_of_2, shared_memory_per_block
from ejkernel.kernels.params import MappedParams, check_positive

__all__ = [
    "DenseDecodeParams",
    "ForwardOnly",
    "PagedDecodeParams",
    "Plan",
    "decode",
    "interpreting",
    "merge_splits",
    "num_splits",
    "supports_decode",
]

_DEFAULT_SMS = 132  # an H200's, what the heuristics target where no GPU is visible
_PROGRAMS_PER_SM = 4  # decode programs are light (4 warps): several share an SM and hide each other's latency
_MIN_BLOCKS_PER_SPLIT = 4  # below this a split's fixed cost (the query load, the merge) stops paying off
_MAX_SPLITS = 128
_MAX_HEAD_DIM = 256
_DTYPES = ("float32", "bfloat16", "float16")
_CACHE_DTYPES = (*_DTYPES, "float8_e4m3fn", "float8_e5m2")  # a float8 cache is read as is, converted in registers


def _check_count(params: Any, name: str, *, zero: bool = False, power_of_two: bool = False) -> None:
    value = getattr(params, name)
    if zero and value == 0 and not isinstance(value, bool):
        return
    check_positive(params, name, power_of_two=power_of_two, what=" (0 = auto)" if zero else "")


@dataclasses.dataclass(frozen=True)
class PagedDecodeParams(MappedParams):
    """Launch parameters of the Triton split-K ``page_attention``.

    ``num_splits``: splits of each sequence's context (programs per (sequence, kv head)); 0 or None: chosen
    from the batch, heads, context and SM count (:func:`num_splits`). ``pages_per_block``: pages per step of a
    program's loop (the keys of one step: ``pages_per_block * page``, raised to a power of two of at least 16).
    ``num_warps`` (a power of two), ``num_stages`` (software pipelining of the loop). None: the heuristic.
    Generic ``num_warps``/``num_stages`` map to them.
    """

    GENERIC: ClassVar[dict[str, str]] = {"num_warps": "num_warps", "num_stages": "num_stages"}
    num_splits: int | None = None
    pages_per_block: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_count(self, "num_splits", zero=True)
        _check_count(self, "pages_per_block")
        _check_count(self, "num_warps", power_of_two=True)
        _check_count(self, "num_stages")


@dataclasses.dataclass(frozen=True)
class DenseDecodeParams(MappedParams):
    """Launch parameters of the Triton split-K ``ragged_decode_attention``.

    ``num_splits``: as :class:`PagedDecodeParams`'s; ``keys_per_block``: keys per step, a power of two >= 16;
    ``num_warps``, ``num_stages``: as there. None: the heuristic. Generic ``kv_blocksize``, ``num_warps`` and
    ``num_stages`` map to them.
    """

    GENERIC: ClassVar[dict[str, str]] = {
        "kv_blocksize": "keys_per_block",
        "num_warps": "num_warps",
        "num_stages": "num_stages",
    }
    num_splits: int | None = None
    keys_per_block: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_count(self, "num_splits", zero=True)
        _check_count(self, "keys_per_block", power_of_two=True)
        if self.keys_per_block is not None and self.keys_per_block < 16:
            raise ValueError(
                f"DenseDecodeParams.keys_per_block must be a power of two >= 16 or None, got {self.keys_per_block!r}"
            )
        _check_count(self, "num_warps", power_of_two=True)
        _check_count(self, "num_stages")


@dataclasses.dataclass(frozen=True)
class ForwardOnly(MappedParams):
    """The backward params of the decode kernels: none (the serving ops are not differentiable). Only an empty
    generic ``BwdParams()`` maps onto it."""


# ------------------------------------------------------------------------------------------------
# Plans: the static launch of one call.
# ------------------------------------------------------------------------------------------------


def interpreting() -> bool:
    """Whether the kernels will run in Triton's interpreter (read from the environment: Triton stays unimported)."""
    if os.environ.get("EJKERNEL_TRITON_INTERPRET") == "1":
        return True
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _sm_count() -> int:
    gpu = first_gpu()
    return (gpu and gpu.sm_count) or _DEFAULT_SMS


def _smem_bytes() -> int:
    gpu = first_gpu()
    return (gpu and gpu.shared_memory_per_block) or shared_memory_per_block((9, 0))


@dataclasses.dataclass(frozen=True)
class Plan:
    """One launch: splits, keys per step (``block_n``, a power of two >= 16), warps, stages."""

    splits: int
    block_n: int
    num_warps: int
    num_stages: int


def num_splits(batch: int, kv_heads: int, max_keys: int, block_n: int, sms: int | None = None) -> int:
    """Splits of each sequence so that ``batch * kv_heads * splits`` programs fill the device (about
    ``_PROGRAMS_PER_SM`` per SM), each split keeping at least ``_MIN_BLOCKS_PER_SPLIT`` key blocks of the longest
    possible sequence (``max_keys``).

    >>> num_splits(1, 8, 32768, 64, sms=132), num_splits(64, 8, 4096, 64, sms=132), num_splits(256, 8, 1024, 64)
    (66, 2, 1)
    """
    programs = batch * kv_heads
    want = cdiv(_PROGRAMS_PER_SM * (sms or _sm_count()), max(programs, 1))
    most = max(1, cdiv(max_keys, block_n) // _MIN_BLOCKS_PER_SPLIT)
    return int(max(1, min(want, most, _MAX_SPLITS)))


def _smem(block_n: int, stages: int, d: int, dv: int, e: int) -> int:
    return e * stages * block_n * (_pow2(d) + _pow2(dv))


def _pow2(n: int) -> int:
    return max(16, next_power_of_2(n))


def default_block(d: int, dv: int, e: int) -> tuple[int, int, int]:
    """(keys per step, warps, stages) on Hopper for a cache of ``e`` bytes per element: 64 keys in 3 stages for
    head dims up to 128, 32 above; twice the keys for a float8 cache (the same bytes per step: measured on the
    H200, 64 float8 keys per step left the loop latency-bound at 1.7 TB/s, 128 reached 2.6); float32 caches drop
    stages until the buffered K/V tiles fit in shared memory.

    >>> default_block(128, 128, 2), default_block(128, 128, 1), default_block(256, 256, 4)
    ((64, 4, 3), (128, 4, 3), (32, 4, 2))
    """
    block_n, warps, stages = (64, 4, 3) if max(d, dv) <= 128 else (32, 4, 2)
    if e == 1:
        block_n *= 2
    while stages > 1 and _smem(block_n, stages, d, dv, e) > _smem_bytes():
        stages -= 1
    return block_n, warps, stages


def make_plan(
    batch: int,
    kv_heads: int,
    max_keys: int,
    d: int,
    dv: int,
    e: int,
    *,
    splits: int | None,
    block_n: int | None,
    num_warps: int | None,
    num_stages: int | None,
) -> Plan:
    """The plan of a call: the given fields, the rest from :func:`default_block` and :func:`num_splits` (in
    Triton's interpreter: 16-key steps and 2 splits, small and quick, still exercising the merge)."""
    if interpreting():
        dn, dw, ds, dsplit = 16, 4, 1, 2
    else:
        dn, dw, ds = default_block(d, dv, e)
        dsplit = 0
    bn = block_n or dn
    s = splits or dsplit or num_splits(batch, kv_heads, max_keys, bn)
    return Plan(int(s), int(bn), int(num_warps or dw), int(num_stages or ds))


# ------------------------------------------------------------------------------------------------
# supports, candidates.
# ------------------------------------------------------------------------------------------------


def arguments(invocation: Any) -> Mapping[str, Any]:
    args = getattr(invocation, "arguments", invocation)
    if not isinstance(args, Mapping):
        raise TypeError(f"expected an invocation with an .arguments mapping, got {type(invocation).__name__}")
    return args


def supports_decode(op: str, query: Any, key: Any, value: Any) -> str | None:
    """None when the decode kernel can run these arrays, else why not."""
    for name, x, allowed in (
        ("query", query, _DTYPES),
        ("key cache", key, _CACHE_DTYPES),
        ("value cache", value, _CACHE_DTYPES),
    ):
        dt = np.dtype(x.dtype)
        if dt.name not in allowed:
            return f"ejkernel-triton {op}: {name} dtype {dt.name} is not supported ({', '.join(allowed)})"
    d, dv = int(query.shape[-1]), int(value.shape[-1])
    if not (1 <= d <= _MAX_HEAD_DIM and 1 <= dv <= _MAX_HEAD_DIM):
        return f"ejkernel-triton {op}: head dims from 1 to {_MAX_HEAD_DIM} are supported, got D={d}, Dv={dv}"
    if importlib.util.find_spec("triton") is None:  # find, don't import: see ejkernel_triton.launch
        return f"ejkernel-triton {op}: triton is not installed"
    return None


def candidate_plans(batch: int, kv_heads: int, max_keys: int, d: int, dv: int, e: int) -> list[Plan]:
    """Plans worth timing, the heuristic's first: splits around the heuristic's (half, double, one), keys per step
    32/64/128, 4 or 8 warps, 2 or 3 stages; none whose buffered tiles overflow shared memory."""
    if interpreting():
        base = make_plan(
            batch, kv_heads, max_keys, d, dv, e, splits=None, block_n=None, num_warps=None, num_stages=None
        )
        return [base, Plan(1, 16, 4, 1), Plan(3, 32, 4, 1)]
    bn0, w0, st0 = default_block(d, dv, e)
    out = [Plan(num_splits(batch, kv_heads, max_keys, bn0), bn0, w0, st0)]
    for bn in (32, 64, 128):
        auto = num_splits(batch, kv_heads, max_keys, bn)
        for splits in dict.fromkeys((auto, max(1, auto // 2), min(_MAX_SPLITS, auto * 2), 1)):
            for warps, stages in ((4, 2), (4, 3), (8, 3)):
                plan = Plan(splits, bn, warps, stages)
                if plan not in out and _smem(bn, stages, d, dv, e) <= _smem_bytes():
                    out.append(plan)
    return out


# ------------------------------------------------------------------------------------------------
# The launch and the merge.
# ------------------------------------------------------------------------------------------------


def merge_splits(o: jax.Array, lse: jax.Array, dtype: Any) -> jax.Array:
    """``out [N, H, Dv]`` from the splits' normalized outputs ``o [N, splits, H, Dv]`` and log-sum-exps
    ``lse [N, splits, H]``, weighted by ``exp(lse - max lse)``; a row no split saw gives zeros."""
    if o.shape[1] == 1:  # the kernel wrote zeros for rows it saw nothing of
        return o[:, 0].astype(dtype)
    m = jnp.max(lse, axis=1, keepdims=True)
    w = jnp.exp(lse - jnp.where(jnp.isfinite(m), m, 0.0))  # 0 for a split that saw nothing
    den = jnp.sum(w, axis=1)
    out = jnp.einsum("nsh,nshd->nhd", w, o) / jnp.where(den > 0, den, 1.0)[..., None]
    return out.astype(dtype)


def _launch(
    plan: Plan,
    page: int,
    paged: bool,
    scale: float,
    softcap: float | None,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lo: jax.Array,
    hi: jax.Array,
    tables: jax.Array,
) -> jax.Array:
    from ejkernel_triton import _decode_kernels as kern
    from ejkernel_triton import launch

    n, h, d = q.shape
    kh, dv = k.shape[-2], v.shape[-1]
    if paged:  # [P, page, KH, D] -> rows [P * page, KH, D]
        num_pages, rows_per_seq = k.shape[0], 0
    else:  # [N, S, KH, D] -> rows [N * S, KH, D]
        num_pages, rows_per_seq = 1, k.shape[1]
    o, lse = launch.launch(
        kern.split_kv_decode,
        q,
        k,
        v,
        lo,
        hi,
        tables,
        float(scale),
        float(softcap) if softcap is not None else 1.0,
        int(tables.shape[1]),
        int(rows_per_seq),
        int(num_pages),
        out_shape=(
            jax.ShapeDtypeStruct((n, plan.splits, h, dv), jnp.float32),
            jax.ShapeDtypeStruct((n, plan.splits, h), jnp.float32),
        ),
        grid=(plan.splits, kh, n),
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
        name="ejkernel_split_kv_decode",
        H=h,
        KH=kh,
        D=d,
        DV=dv,
        BLOCK_H=_pow2(h // kh),
        BLOCK_D=_pow2(d),
        BLOCK_DV=_pow2(dv),
        BLOCK_N=plan.block_n,
        PAGE=page,
        PAGED=paged,
        NUM_SPLITS=plan.splits,
        HAS_SOFTCAP=softcap is not None,
    )
    return merge_splits(o, lse, q.dtype)


_DUMMY_TABLE = np.zeros((1, 1), np.int32)  # the dense kernel reads no table


def decode(
    plan: Plan,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    lo: jax.Array,
    hi: jax.Array,
    tables: jax.Array | None,
    *,
    page: int,
    scale: float,
    softcap: float | None,
) -> jax.Array:
    """``out [N, H, Dv]``: every sequence's query against its keys ``[lo, hi)`` (int32, already clamped into the
    cache) of a paged cache (``tables`` given: ``key [P, page, KH, D]``) or a dense one (``key [N, S, KH, D]``).

    Under ``jax.vmap`` one launch over the folded batch: the rows of the query, the intervals and the tables
    fold into ``N``; a paged cache is shared, a dense one folds with them."""
    paged = tables is not None
    table = tables if paged else jnp.asarray(_DUMMY_TABLE)
    cache_axis = None if paged else 0
    run = fold_vmap(
        functools.partial(_launch, plan, page, paged, scale, softcap),
        (0, cache_axis, cache_axis, 0, 0, 0 if paged else None),
        0,
    )
    return run(query, key, value, lo, hi, table)
