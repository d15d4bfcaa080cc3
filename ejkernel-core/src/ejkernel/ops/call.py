"""``Call``: one validated call of an op, bound once, handed whole to implementations that take it.

An implementation registered with ``takes_call=True`` is ``fn(call, *, fwd_params, bwd_params)``: it reads
the arrays and options it needs by canonical name (``call.query``, ``call["causal"]``) instead of
retyping the op's parameter list. It declares the options it understands when it registers; a call that
sets any other option never reaches it (the registry declines it with the reason).

>>> import jax.numpy as jnp
>>> call = Call("my_op", {"x": jnp.ones(3), "scale": 2.0})
>>> call.scale, call["x"].shape, "scale" in call
(2.0, (3,), True)
>>> call.replace(scale=3.0).scale
3.0
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any


@dataclasses.dataclass(frozen=True, eq=False)
class Call(Mapping[str, Any]):
    """The op's name and its arguments by canonical name (validated, normalized, defaults filled in)."""

    op: str
    arguments: Mapping[str, Any]

    def __post_init__(self) -> None:
        object.__setattr__(self, "arguments", MappingProxyType(dict(self.arguments)))

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["arguments"][name]
        except KeyError:
            raise AttributeError(f"{self.__dict__.get('op', 'call')} has no argument {name!r}") from None

    def __getitem__(self, name: str) -> Any:
        return self.arguments[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.arguments)

    def __len__(self) -> int:
        return len(self.arguments)

    def replace(self, **changes: Any) -> Call:
        """A copy with some arguments changed (e.g. a kernel that pads its inputs)."""
        unknown = sorted(set(changes) - set(self.arguments))
        if unknown:
            raise TypeError(f"{self.op}: no argument(s) {unknown} to replace")
        return Call(self.op, {**self.arguments, **changes})
