"""Tunable launch parameters of a kernel, one set for the forward pass and one for the backward.

Every field is optional: ``None`` means "the implementation's own default". The dataclasses are
frozen and hashable so that they can be static arguments under ``jax.jit`` and cache keys.

>>> from ejkernel.kernels.params import FwdParams
>>> p = FwdParams(q_blocksize=128, kv_blocksize=64, num_warps=4)
>>> FwdParams.from_dict(p.to_dict()) == p
True
"""

from __future__ import annotations

import dataclasses
from typing import Any, Self


@dataclasses.dataclass(frozen=True)
class _LaunchParams:
    q_blocksize: int | None = None
    kv_blocksize: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{type(self).__name__}.{f.name} must be a positive int or None, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown field(s) {unknown}; expected a subset of {sorted(names)}")
        return cls(**data)


@dataclasses.dataclass(frozen=True)
class FwdParams(_LaunchParams):
    """Launch parameters of a forward kernel (block sizes along queries and keys, warps, pipeline stages)."""


@dataclasses.dataclass(frozen=True)
class BwdParams(_LaunchParams):
    """Launch parameters of a backward kernel (block sizes along queries and keys, warps, pipeline stages)."""
