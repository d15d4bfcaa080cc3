"""The launch parameters of the XLA implementations whose knobs are not flash-attention block sizes.

Each class is what one implementation lets the config chain choose and the autotuner time (design §5),
with fields named for what they mean; the registrations in ``ejkernel_xla.plugin`` name them. A field is
``None`` for "the implementation's default for the call"; values are checked when the params are made
(``ValueError`` naming the class and the field). A ``cfg=`` written with the generic ``FwdParams`` /
``BwdParams`` is mapped by :meth:`from_generic` (``q_blocksize=64`` is ``ChunkParams(chunk_size=64)``
for ``gla``); a generic field that means nothing to the implementation is refused, never ignored.

The blockwise attention kernels (``flash_attention``, ``scaled_dot_product_attention``,
``block_sparse_attention``, ``native_sparse_attention``, ``multi_head_latent_attention``, ``ring_attention``)
tile queries and keys and keep the generic classes.

>>> from ejkernel.kernels.params import FwdParams
>>> ChunkParams.from_generic(FwdParams(q_blocksize=64))
ChunkParams(chunk_size=64)
>>> PagedParams.from_generic(FwdParams(q_blocksize=4, kv_blocksize=64))
PagedParams(keys_per_block=64, seqs_per_chunk=4)
>>> ChunkParams(chunk_size=48)
Traceback (most recent call last):
ValueError: ChunkParams.chunk_size must be a power of two (1 = the step-by-step recurrence) or None, got 48
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from ejkernel.kernels.params import MappedParams as _Mapped
from ejkernel.kernels.params import check_positive, coerce, map_generic


@dataclasses.dataclass(frozen=True)
class NoParams(_Mapped):
    """No launch parameters: ``attention`` (one fused dense pass), ``mean_pooling`` (one reduction), the
    ``ragged_dot`` ``grouped_matmul``, and the backward of the ops that are not differentiable
    (``page_attention``, ``ragged_page_attention``, ``ragged_decode_attention``). Only an empty generic
    ``FwdParams()``/``BwdParams()`` maps onto it."""


@dataclasses.dataclass(frozen=True)
class ChunkParams(_Mapped):
    """``gla``, ``lightning_attn`` and ``recurrent`` (the linear-attention engine, ``_linear_attention``).

    ``chunk_size``: tokens per chunk of the chunked form, a power of two (1: the step-by-step recurrence);
    used up to the next power of two of ``T``. None: the heuristic (``_linear_attention.chunk_size``).
    Generic ``q_blocksize`` maps to it.
    """

    GENERIC: ClassVar[dict[str, str]] = {"q_blocksize": "chunk_size"}
    chunk_size: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(self, "chunk_size", power_of_two=True, what=" (1 = the step-by-step recurrence)")


@dataclasses.dataclass(frozen=True)
class DeltaRuleParams(_Mapped):
    """``gated_delta_rule``: ``chunk_size``, tokens per chunk (any positive int; 1: the token-by-token
    recurrence). None: ``default_chunk`` (the backward: the forward's). Generic ``q_blocksize`` maps to it."""

    GENERIC: ClassVar[dict[str, str]] = {"q_blocksize": "chunk_size"}
    chunk_size: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(self, "chunk_size")


@dataclasses.dataclass(frozen=True)
class TiledGmmParams(_Mapped):
    """``grouped_matmul`` (the tiled scan): ``block_m``, rows of ``lhs`` per tile (any positive int). None:
    ``default_tile`` (the backward: the forward's). Generic ``q_blocksize`` maps to it."""

    GENERIC: ClassVar[dict[str, str]] = {"q_blocksize": "block_m"}
    block_m: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(self, "block_m")


@dataclasses.dataclass(frozen=True)
class PagedParams(_Mapped):
    """``page_attention`` (forward only).

    ``keys_per_block``: keys per block, rounded down to whole pages (at least one page, at most the table);
    ``seqs_per_chunk``: sequences processed together (chunks run one after another, each over the blocks its
    longest sequence needs). None: the heuristic (the chunk then follows from the key block). Generic
    ``kv_blocksize`` and ``q_blocksize`` map to them.
    """

    GENERIC: ClassVar[dict[str, str]] = {"kv_blocksize": "keys_per_block", "q_blocksize": "seqs_per_chunk"}
    keys_per_block: int | None = None
    seqs_per_chunk: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(self, "keys_per_block")
        check_positive(self, "seqs_per_chunk")


@dataclasses.dataclass(frozen=True)
class RaggedPagedParams(_Mapped):
    """``ragged_page_attention`` (forward only).

    ``rows_per_item``: query rows per work item (a decode sequence fills one row of its item: small values
    suit decode-heavy batches, large ones prefill), at most ``T``; ``keys_per_block``: keys per block,
    rounded down to whole pages (at least one). Items per chunk follow from both. None: the heuristic.
    Generic ``q_blocksize`` and ``kv_blocksize`` map to them.
    """

    GENERIC: ClassVar[dict[str, str]] = {"q_blocksize": "rows_per_item", "kv_blocksize": "keys_per_block"}
    rows_per_item: int | None = None
    keys_per_block: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(self, "rows_per_item")
        check_positive(self, "keys_per_block")


@dataclasses.dataclass(frozen=True)
class RaggedDecodeParams(_Mapped):
    """``ragged_decode_attention`` (forward only).

    ``keys_per_block``: keys per block (at most ``S``); ``rows_per_chunk``: batch rows processed together
    (each chunk loops over the blocks its rows' ranges cover). None: the heuristic (the chunk then follows
    from the key block). Generic ``kv_blocksize`` and ``q_blocksize`` map to them.
    """

    GENERIC: ClassVar[dict[str, str]] = {"kv_blocksize": "keys_per_block", "q_blocksize": "rows_per_chunk"}
    keys_per_block: int | None = None
    rows_per_chunk: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(self, "keys_per_block")
        check_positive(self, "rows_per_chunk")


__all__ = [
    "ChunkParams",
    "DeltaRuleParams",
    "NoParams",
    "PagedParams",
    "RaggedDecodeParams",
    "RaggedPagedParams",
    "TiledGmmParams",
    "check_positive",
    "coerce",
    "map_generic",
]
