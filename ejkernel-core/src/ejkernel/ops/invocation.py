"""``Invocation``: one call of an op, as the config chain sees it (abstract shapes and static options)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np


def is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | jax.ShapeDtypeStruct) or isinstance(x, jax.core.Tracer)


def abstract(x: Any) -> Any:
    """Arrays (concrete or traced) become ``jax.ShapeDtypeStruct``; everything else stays as it is."""
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype) if is_array(x) else x


def _jsonable(x: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):
        return f"{np.dtype(x.dtype).name}{list(x.shape)}"
    if isinstance(x, tuple | list):
        return [_jsonable(v) for v in x]
    if isinstance(x, float | int | bool | str) or x is None:
        return x
    return repr(x)


@dataclasses.dataclass(frozen=True)
class Invocation:
    """The op, its arguments by canonical name (arrays as ``jax.ShapeDtypeStruct``) and the backend it runs on.

    >>> import jax, jax.numpy as jnp
    >>> inv = Invocation.create("my_op", {"x": jnp.ones((2, 3)), "scale": 0.5}, backend="cpu")
    >>> inv.key()
    '{"scale":0.5,"x":"float32[2, 3]"}'
    >>> inv.arguments["x"].shape
    (2, 3)
    """

    op: str
    arguments: Mapping[str, Any]
    backend: str

    @classmethod
    def create(cls, op: str, arguments: Mapping[str, Any], backend: str) -> Invocation:
        return cls(op, {k: abstract(v) for k, v in arguments.items()}, backend)

    def to_json(self) -> dict[str, Any]:
        return {k: _jsonable(v) for k, v in sorted(self.arguments.items())}

    def key(self) -> str:
        """Shapes, dtypes and static options as canonical JSON: the part of the cache key that is the call."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    def describe(self) -> str:
        """A short human-readable form: the arrays with their shapes, then the options that are set."""
        parts = [f"{k}={v}" for k, v in self.to_json().items() if v is not None and v is not False and v != 0.0]
        return f"{self.op}({', '.join(parts)}) on {self.backend}"
