"""The launch parameters of the Mosaic TPU kernels whose knobs are not flash-attention block sizes.

Each class is what one kernel lets the config chain choose and the autotuner time (design §5), with fields
named for what they mean; the registrations in ``ejkernel_pallas.plugin`` name them (``TPU_PARAMS``). A
field is ``None`` for "the kernel's default for the call"; values are checked when the params are made
(``ValueError`` naming the class and the field). A ``cfg=`` written with the generic ``FwdParams`` /
``BwdParams`` is mapped by :meth:`from_generic` (``q_blocksize=64`` is ``GlaChunkParams(chunk_size=64)``);
a generic field that means nothing to the kernel is refused, never ignored.

``flash_attention``, ``block_sparse_attention`` and ``multi_head_latent_attention`` tile queries and keys
and keep the generic classes.

>>> from ejkernel.kernels.params import FwdParams
>>> GmmParams.from_generic(FwdParams(q_blocksize=256, kv_blocksize=128))
GmmParams(block_m=256, block_n=128)
>>> PagedKeyParams.from_generic(FwdParams(q_blocksize=8))  # doctest: +ELLIPSIS
Traceback (most recent call last):
ValueError: PagedKeyParams has no field for ['q_blocksize'] of FwdParams: ...
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from ejkernel.kernels.params import MappedParams as _Mapped
from ejkernel.kernels.params import check_positive, coerce, map_generic


@dataclasses.dataclass(frozen=True)
class ForwardOnly(_Mapped):
    """The backward params of the forward-only kernels (``page_attention``, ``ragged_page_attention``,
    ``ragged_decode_attention``): none. Only an empty generic ``BwdParams()`` maps onto it."""


@dataclasses.dataclass(frozen=True)
class GlaChunkParams(_Mapped):
    """``gla``: ``chunk_size``, tokens per chunk, a power of two from 16 to 128 (``T`` is padded to it; used up
    to ``T`` rounded up to a power of two, at least 16). None: 64. Generic ``q_blocksize`` maps to it."""

    GENERIC: ClassVar[dict[str, str]] = {"q_blocksize": "chunk_size"}
    chunk_size: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(self, "chunk_size", power_of_two=True, within=(16, 128))


@dataclasses.dataclass(frozen=True)
class GmmParams(_Mapped):
    """``grouped_matmul`` (``gmm``/``tgmm``), in the op's letters (``lhs [M, K]``, ``out [M, N]``).

    ``block_m``: the row tile, rounded up to a multiple of 128 (all the rows, rounded up to 16, when fewer);
    ``block_n``: the tile of N (the output columns of the forward and of ``d rhs``, the contracted dim of
    ``d lhs``), rounded up to a multiple of 128, at most N rounded up to 128. The K tile is no parameter
    (see the kernel's module). None: the kernel's default. Generic ``q_blocksize``/``kv_blocksize`` map to
    ``block_m``/``block_n``.
    """

    GENERIC: ClassVar[dict[str, str]] = {"q_blocksize": "block_m", "kv_blocksize": "block_n"}
    block_m: int | None = None
    block_n: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(self, "block_m")
        check_positive(self, "block_n")


@dataclasses.dataclass(frozen=True)
class PagedKeyParams(_Mapped):
    """``page_attention`` (one sequence per grid step): ``keys_per_block``, keys per block, rounded down to
    whole pages (at least one page, at most 16 pages, the table's width and the VMEM budget). None: 512.
    Generic ``kv_blocksize`` maps to it."""

    GENERIC: ClassVar[dict[str, str]] = {"kv_blocksize": "keys_per_block"}
    keys_per_block: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(self, "keys_per_block")


@dataclasses.dataclass(frozen=True)
class DecodeKeyParams(_Mapped):
    """``ragged_decode_attention`` (one batch row per grid step): ``keys_per_block``, keys per block, rounded up
    to a multiple of 8, at most ``S`` and the VMEM budget. None: 512. Generic ``kv_blocksize`` maps to it."""

    GENERIC: ClassVar[dict[str, str]] = {"kv_blocksize": "keys_per_block"}
    keys_per_block: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(self, "keys_per_block")


@dataclasses.dataclass(frozen=True)
class RaggedItemParams(_Mapped):
    """``ragged_page_attention``: ``rows_per_item``, query rows per work item (at most ``T`` and the VMEM
    budget; None: a power of two near the mean query length); ``keys_per_block``, keys per block, rounded
    down to whole pages (as ``PagedKeyParams``). Generic ``q_blocksize``/``kv_blocksize`` map to them."""

    GENERIC: ClassVar[dict[str, str]] = {"q_blocksize": "rows_per_item", "kv_blocksize": "keys_per_block"}
    rows_per_item: int | None = None
    keys_per_block: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(self, "rows_per_item")
        check_positive(self, "keys_per_block")


__all__ = [
    "DecodeKeyParams",
    "ForwardOnly",
    "GlaChunkParams",
    "GmmParams",
    "PagedKeyParams",
    "RaggedItemParams",
    "check_positive",
    "coerce",
    "map_generic",
]
