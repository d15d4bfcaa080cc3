"""Launch parameters: what an implementation lets the config chain choose and the autotuner time.

Every implementation declares its own frozen dataclasses, one for the forward pass and one for the
backward, subclasses of :class:`LaunchParams` (a split-K decode says ``num_splits`` and
``pages_per_block``, a grouped matmul ``block_m``/``block_n``/``block_k``/``group_m``). They are
hashable, so they can be static arguments under ``jax.jit`` and parts of cache keys, and they
round-trip through JSON (the persistent cache) with :meth:`LaunchParams.to_dict`/:meth:`from_dict`.

:class:`FwdParams` and :class:`BwdParams` are the generic carrier of the seed's API (block sizes
along queries and keys, warps, stages): the implementations that take them directly use them as
their own classes, and a class of its own may accept them through :meth:`LaunchParams.from_generic`.

>>> import dataclasses
>>> from ejkernel.kernels.params import FwdParams, LaunchParams
>>> p = FwdParams(q_blocksize=128, kv_blocksize=64, num_warps=4)
>>> FwdParams.from_dict(p.to_dict()) == p
True
>>> @dataclasses.dataclass(frozen=True)
... class SplitKParams(LaunchParams):
...     num_splits: int = 1
...     pages_per_block: int = 8
>>> SplitKParams.from_dict({"num_splits": 4})
SplitKParams(num_splits=4, pages_per_block=8)
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Self, TypeVar

_SCALARS = (bool, int, float, str)


@dataclasses.dataclass(frozen=True)
class LaunchParams:
    """Base of every implementation's launch-parameter class: frozen, hashable, JSON scalars only."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None and not isinstance(value, _SCALARS):
                raise TypeError(f"{type(self).__name__}.{f.name} must be a number, string, bool or None, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        """The fields that are set (not ``None``): what the caches store."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        """The params of ``data`` (from :meth:`to_dict`); ``ValueError`` names a field the class does not have."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown field(s) {unknown}; expected a subset of {sorted(names)}")
        return cls(**data)

    @classmethod
    def from_generic(cls, params: FwdParams | BwdParams) -> Self:
        """These params from the seed's generic :class:`FwdParams`/:class:`BwdParams`, for a ``cfg=`` written with
        them. The default maps the fields both classes have and refuses any other set field."""
        names = {f.name for f in dataclasses.fields(cls)}
        given = params.to_dict()
        foreign = sorted(set(given) - names)
        if foreign:
            raise ValueError(
                f"{cls.__name__} has no field(s) {foreign} of {type(params).__name__}; "
                f"pass {cls.__name__}({', '.join(sorted(names))}) instead"
            )
        return cls(**given)


@dataclasses.dataclass(frozen=True)
class _BlockParams(LaunchParams):
    q_blocksize: int | None = None
    kv_blocksize: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{type(self).__name__}.{f.name} must be a positive int or None, got {value!r}")


@dataclasses.dataclass(frozen=True)
class FwdParams(_BlockParams):
    """Launch parameters of a forward kernel (block sizes along queries and keys, warps, pipeline stages)."""


@dataclasses.dataclass(frozen=True)
class BwdParams(_BlockParams):
    """Launch parameters of a backward kernel (block sizes along queries and keys, warps, pipeline stages)."""


# -- helpers for implementations' own classes (shared by the plugins) ----------------------------------

P = TypeVar("P", bound=LaunchParams)


def check_positive(
    params: LaunchParams,
    name: str,
    *,
    power_of_two: bool = False,
    within: tuple[int, int] | None = None,
    what: str = "",
) -> None:
    """Raise ``ValueError`` unless ``params.<name>`` is None or a positive int (a power of two, within the
    bounds, if asked); ``what`` adds a note to the message."""
    value = getattr(params, name)
    if value is None:
        return
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    if ok and power_of_two:
        ok = value & (value - 1) == 0
    if ok and within is not None:
        ok = within[0] <= value <= within[1]
    if not ok:
        kind = "a power of two" if power_of_two else "a positive int"
        if within is not None:
            kind += f" from {within[0]} to {within[1]}"
        raise ValueError(f"{type(params).__name__}.{name} must be {kind}{what} or None, got {value!r}")


def map_generic(cls: type[P], params: FwdParams | BwdParams, mapping: dict[str, str]) -> P:
    """``cls`` from the generic ``params``: each field of ``mapping`` (generic name -> field of ``cls``) carried
    over; a set field it does not list meant nothing to the implementation and is refused, named."""
    given = params.to_dict()
    foreign = sorted(set(given) - set(mapping))
    if foreign:
        fields = ", ".join(f.name for f in dataclasses.fields(cls))
        carried = ", ".join(f"{k} -> {v}" for k, v in mapping.items()) or "none"
        raise ValueError(
            f"{cls.__name__} has no field for {foreign} of {type(params).__name__}: they mean nothing to this "
            f"implementation (the generic fields it maps: {carried}); pass {cls.__name__}({fields}) instead"
        )
    return cls(**{mapping[k]: v for k, v in given.items()})


class MappedParams(LaunchParams):
    """A class whose ``from_generic`` follows ``GENERIC`` (generic field -> own field)."""

    GENERIC: ClassVar[dict[str, str]] = {}

    @classmethod
    def from_generic(cls, params: FwdParams | BwdParams) -> Self:
        return map_generic(cls, params, cls.GENERIC)


def coerce(cls: type[P], params: Any) -> P | None:
    """``params`` as ``cls`` for a kernel called directly (not through the config chain, which does this):
    ``None``, a ``cls``, or the generic ``FwdParams``/``BwdParams`` mapped by ``cls.from_generic``."""
    if params is None or isinstance(params, cls):
        return params
    if type(params) in (FwdParams, BwdParams):
        return cls.from_generic(params)
    raise TypeError(f"expected {cls.__name__} (or the generic FwdParams/BwdParams), got {type(params).__name__}")
