"""``MaskInfo``: an attention mask described by its rules rather than spelled out as a dense ``[B, H, T, S]`` array.

Causal, sliding window, segment ids, per-sequence key lengths and prefix-LM are each a key interval per query
row (``ejkernel.kernels.signatures._attention.mask_intervals``), so a kernel can skip every key block that no
row of a query block admits, and needs no ``O(T * S)`` mask in memory. Pass it as ``attention_mask`` of
:func:`ejkernel.modules.flash_attention`; dense boolean masks still work.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.kernels.signatures._attention import attention_allowed, normalize_window


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class MaskInfo:
    """Which keys each query attends, as rules; combine rules with ``&``.

    Shapes: B batch, T query length, S key length.

    Attributes:
        causal: query ``i`` attends keys ``j <= i + S - T`` (bottom-right aligned).
        sliding_window: ``(left, right)`` keys around the aligned diagonal, or ``w`` for ``(w, w)``.
        q_segment_ids, kv_segment_ids: ``[B, T]`` and ``[B, S]`` ints; attend only within equal ids.
        kv_lengths: ``[B]`` ints; sequence ``b`` has keys ``j < kv_lengths[b]`` (the rest is padding).
        prefix_lengths: ``[B]`` ints, prefix-LM: with ``causal``, keys ``j < prefix_lengths[b]`` are seen by
            every query of sequence ``b`` (the prefix attends bidirectionally, the rest causally).

    A query row that admits no key gives zeros. The arrays are pytree leaves, so a ``MaskInfo`` passes
    through ``jax.jit`` as an argument; the rules (``causal``, ``sliding_window``) are static.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from ejkernel.modules import MaskInfo, flash_attention
        >>> q = k = v = jax.random.normal(jax.random.key(0), (2, 64, 4, 32))
        >>> mask = MaskInfo.from_lengths(jnp.array([64, 40])) & MaskInfo.prefix_lm(jnp.array([16, 8]))
        >>> mask.to_dense(64, 64).shape  # what it means, as a dense mask [B, 1, T, S]
        (2, 1, 64, 64)
        >>> flash_attention(q, k, v, attention_mask=mask).shape
        (2, 64, 4, 32)
    """

    causal: bool = False
    sliding_window: int | tuple[int, int] | None = None
    q_segment_ids: Any = None
    kv_segment_ids: Any = None
    kv_lengths: Any = None
    prefix_lengths: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.causal, bool):
            raise TypeError(f"MaskInfo: causal must be a bool, got {type(self.causal).__name__}")
        if (self.q_segment_ids is None) != (self.kv_segment_ids is None):
            raise ValueError("MaskInfo: pass both q_segment_ids and kv_segment_ids, or neither")
        if self.prefix_lengths is not None and not self.causal:
            raise ValueError("MaskInfo: prefix_lengths needs causal=True (the prefix is what every row sees)")

    # ---- constructors ---------------------------------------------------------------------------------

    @classmethod
    def causal_mask(cls) -> MaskInfo:
        """Causal attention (bottom-right aligned)."""
        return cls(causal=True)

    @classmethod
    def window(cls, sliding_window: int | tuple[int, int], *, causal: bool = False) -> MaskInfo:
        """A sliding window ``(left, right)`` (or ``w``: ``(w, w)``), causal or not."""
        return cls(causal=causal, sliding_window=sliding_window)

    @classmethod
    def from_segment_ids(cls, q_segment_ids: Any, kv_segment_ids: Any = None) -> MaskInfo:
        """Packed sequences: attend within equal ids (``kv_segment_ids`` defaults to ``q_segment_ids``)."""
        return cls(
            q_segment_ids=q_segment_ids, kv_segment_ids=q_segment_ids if kv_segment_ids is None else kv_segment_ids
        )

    @classmethod
    def from_lengths(cls, kv_lengths: Any, *, causal: bool = False) -> MaskInfo:
        """Right-padded keys: sequence ``b`` has ``kv_lengths[b]`` of them."""
        return cls(causal=causal, kv_lengths=kv_lengths)

    @classmethod
    def prefix_lm(cls, prefix_lengths: Any) -> MaskInfo:
        """Prefix-LM: the first ``prefix_lengths[b]`` keys are seen by every query, the rest causally."""
        return cls(causal=True, prefix_lengths=prefix_lengths)

    # ---- combining ------------------------------------------------------------------------------------

    def __and__(self, other: MaskInfo) -> MaskInfo:
        """Both masks at once (a key is attended when both admit it)."""
        if not isinstance(other, MaskInfo):
            return NotImplemented
        fields: dict[str, Any] = {"causal": self.causal or other.causal}
        fields["sliding_window"] = _intersect_windows(self.sliding_window, other.sliding_window)
        for pair in (("q_segment_ids", "kv_segment_ids"), ("prefix_lengths",)):
            mine, theirs = getattr(self, pair[0]), getattr(other, pair[0])
            if mine is not None and theirs is not None:
                raise ValueError(f"MaskInfo: both masks set {' / '.join(pair)}; combine them into one first")
            for name in pair:
                fields[name] = getattr(self if mine is not None else other, name)
        a, b = self.kv_lengths, other.kv_lengths
        fields["kv_lengths"] = a if b is None else b if a is None else jnp.minimum(a, b)
        return MaskInfo(**fields)

    # ---- meaning ----------------------------------------------------------------------------------------

    def to_dense(self, t: int, s: int) -> jax.Array:
        """The boolean mask it describes, ``[B|1, 1, T, S]`` (True = attend): for checking, not for kernels."""
        allowed = attention_allowed(
            t,
            s,
            causal=self.causal,
            sliding_window=self.sliding_window,
            kv_lengths=self.kv_lengths,
            prefix_lengths=self.prefix_lengths,
        )
        allowed = allowed[:, None] if allowed.ndim == 3 else allowed[None, None]
        if self.q_segment_ids is not None:
            q, kv = jnp.asarray(self.q_segment_ids), jnp.asarray(self.kv_segment_ids)
            allowed = allowed & (q[:, None, :, None] == kv[:, None, None, :])
        return allowed

    def flash_attention_arguments(self) -> dict[str, Any]:
        """The ``flash_attention`` keywords it stands for."""
        return {
            "causal": self.causal,
            "sliding_window": self.sliding_window,
            "q_segment_ids": self.q_segment_ids,
            "kv_segment_ids": self.kv_segment_ids,
            "kv_lengths": self.kv_lengths,
            "prefix_lengths": self.prefix_lengths,
        }

    # ---- pytree -----------------------------------------------------------------------------------------

    def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        leaves = (self.q_segment_ids, self.kv_segment_ids, self.kv_lengths, self.prefix_lengths)
        return leaves, (self.causal, normalize_window(self.sliding_window))

    @classmethod
    def tree_unflatten(cls, aux: tuple[Any, ...], leaves: Any) -> MaskInfo:
        obj = object.__new__(cls)  # no validation: under jax transformations the leaves may be anything
        for name, value in zip(("causal", "sliding_window"), aux, strict=True):
            object.__setattr__(obj, name, value)
        for name, value in zip(
            ("q_segment_ids", "kv_segment_ids", "kv_lengths", "prefix_lengths"), leaves, strict=True
        ):
            object.__setattr__(obj, name, value)
        return obj


def _intersect_windows(a: Any, b: Any) -> tuple[int, int] | None:
    wa, wb = normalize_window(a), normalize_window(b)
    if wa is None or wb is None:
        return wa or wb
    return (min(wa[0], wb[0]), min(wa[1], wb[1]))


def merge_mask_info(mask: MaskInfo, given: dict[str, Any], op: str) -> dict[str, Any]:
    """``flash_attention``'s keywords with ``mask``'s rules folded in (``attention_mask`` becomes None).

    A rule set both ways is refused unless the two agree or combine without ambiguity (``causal`` is
    or-ed, windows intersect, key lengths take the minimum).
    """
    out = dict(given, attention_mask=None)
    rules = mask.flash_attention_arguments()
    out["causal"] = bool(given["causal"]) or rules["causal"]
    out["sliding_window"] = _intersect_windows(given["sliding_window"], rules["sliding_window"])
    for name in ("q_segment_ids", "kv_segment_ids", "prefix_lengths"):
        if rules[name] is not None:
            if given[name] is not None:
                raise ValueError(f"{op}: {name} is given both directly and by attention_mask (a MaskInfo); pass one")
            out[name] = rules[name]
    if rules["kv_lengths"] is not None:
        out["kv_lengths"] = (
            rules["kv_lengths"]
            if given["kv_lengths"] is None
            else jnp.minimum(given["kv_lengths"], rules["kv_lengths"])
        )
    return out


__all__ = ["MaskInfo"]
