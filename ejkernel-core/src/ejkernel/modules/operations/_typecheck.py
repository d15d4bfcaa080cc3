"""The public functions' annotations, checked when they are called (under ``jit``: when traced, so free).

Each public op function is annotated with jaxtyping (``Float[ArrayIn, "B T H D"]``: dtype kind and named
dimensions, shared across the arguments of one call; ``N1`` is the ``N+1`` of ``N`` packed sequences' offsets,
since jaxtyping cannot bind a dimension from a sum). ``@checked`` checks a call against them with jaxtyping and
beartype. When they refuse it, the op's own validation runs (it gives the message that names the argument and
what was expected), and jaxtyping's message, with the size it bound to each named dimension, is appended.

The annotations are a summary of the contract, not the contract: where they refuse a call that the op's
validation accepts, the call goes on and a warning says so once (``EJKERNEL_TYPECHECK=strict`` makes it an
error: the test suite runs that way, so that the annotations stay true). ``EJKERNEL_TYPECHECK=0`` turns the
check off. Without beartype installed, nothing is checked.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])
_warned: set[str] = set()


def _mode() -> str:
    return os.environ.get("EJKERNEL_TYPECHECK", "1").strip().lower()


def _summary(message: str) -> str:
    """jaxtyping's message without its dump of every parameter: which one, its value, its annotation, and the
    size each named dimension was bound to."""
    text = " ".join(message.split())
    union = r"typing\.Union\[(\w+)\[jaxlib\._jax\.Array, ('[^']*')\], \1\[ndarray, \2\](, NoneType)?\]"
    text = re.sub(union, lambda m: f"{m[1]}[Array | ndarray, {m[2]}]" + (" | None" if m[3] else ""), text)
    found = re.search(r"typechecking parameter '(\w+)'\. Actual value: (.*?) Expected type: (.*?)\. -{4,}", text)
    if found is None:
        return text
    out = f"parameter {found[1]} is {found[2]}, annotated {found[3]}"
    dims = re.search(r"axis annotation are as follows\. (.*?)\)?$", text)
    return out + (f"; named dimensions bound by the other arguments: {dims[1]}" if dims else "")


def checked(fn: F) -> F:
    """``fn`` with its annotations checked at each call (see the module docstring)."""
    try:
        import jaxtyping
        from beartype import BeartypeConf, beartype
    except ImportError:  # beartype is optional at run time: the op's own validation still runs
        return fn
    # is_pep484_tower: an int where a float is annotated passes, as Python's typing (and mypy) has it.
    typed = jaxtyping.jaxtyped(typechecker=beartype(conf=BeartypeConf(is_pep484_tower=True)))(fn)
    name = fn.__name__
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        mode = _mode()
        if mode in ("0", "off", "false"):
            return fn(*args, **kwargs)
        try:
            signature.bind(*args, **kwargs)
        except TypeError:  # a misspelt or missing argument: Python's own message, which names the function
            return fn(*args, **kwargs)
        try:
            return typed(*args, **kwargs)
        except jaxtyping.TypeCheckError as e:
            refused = _summary(str(e))
        try:
            out = fn(*args, **kwargs)
        except (ValueError, TypeError) as ours:
            if type(ours) in (ValueError, TypeError):
                raise type(ours)(f"{ours}\n(annotations of {name}: {refused})") from None
            raise
        if mode == "strict":
            raise TypeError(f"{name}: its annotations refuse a call that its contract accepts: {refused}")
        if name not in _warned:
            _warned.add(name)
            warnings.warn(
                f"{name}: its annotations refuse a call that its contract accepts (a bug of ejkernel's: "
                f"please report it); the call goes on. {refused}",
                stacklevel=2,
            )
        return out

    return call  # type: ignore[return-value]
