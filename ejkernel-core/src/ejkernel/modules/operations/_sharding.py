"""Running a module function under ``jax.shard_map`` when the caller passes ``mesh``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from ejkernel.ops.invocation import is_array


def maybe_shard_map(
    op: str,
    fn: Callable[..., Any],
    arrays: Mapping[str, Any],
    options: Mapping[str, Any],
    *,
    mesh: Any,
    in_specs: Any,
    out_specs: Any,
) -> Any:
    """``fn(**arrays, **options)``, under ``shard_map(mesh, in_specs, out_specs)`` when ``mesh`` is given.

    ``in_specs`` covers the arrays the caller passed, in signature order (e.g. three specs for
    q, k, v), or is a dict from argument name to spec.

    Raises:
        ValueError: ``in_specs``/``out_specs`` missing or not matching the arrays passed.
    """
    if mesh is None:
        if in_specs is not None or out_specs is not None:
            raise ValueError(f"{op}: in_specs/out_specs are only used with mesh=; pass mesh too")
        return fn(**arrays, **options)
    passed = {k: v for k, v in arrays.items() if is_array(v)}
    if in_specs is None or out_specs is None:
        raise ValueError(f"{op}: with mesh=, pass in_specs (one per array passed: {list(passed)}) and out_specs")
    if isinstance(in_specs, Mapping):
        unknown = sorted(set(in_specs) - set(passed))
        if unknown:
            raise ValueError(f"{op}: in_specs names {unknown}, which are not arrays of this call ({list(passed)})")
        specs = {k: in_specs.get(k, jax.sharding.PartitionSpec()) for k in passed}
    else:
        if not isinstance(in_specs, Sequence) or len(in_specs) != len(passed):
            n = len(in_specs) if isinstance(in_specs, Sequence) else type(in_specs).__name__
            raise ValueError(f"{op}: in_specs must have one spec per array passed ({list(passed)}), got {n}")
        specs = dict(zip(passed, in_specs, strict=True))
    rest = {k: v for k, v in arrays.items() if k not in passed}

    def body(sharded: dict[str, Any]) -> Any:
        return fn(**sharded, **rest, **options)

    # check_vma=False: kernels (Triton, Pallas, loops with fresh accumulators) do not annotate
    # which mesh axes their values vary over; the specs the caller gives are the contract.
    return jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=out_specs, check_vma=False)(passed)
