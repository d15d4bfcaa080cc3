"""The device layer every plugin shares: what the device is, grid arithmetic, and how a launcher takes vmap.

* :class:`DeviceInfo` / :func:`device_info`: platform, kind, CUDA compute capability, SM count, shared
  memory per block, HBM bandwidth and peak bf16 FLOP/s of a device. jax says what it knows (a CUDA
  device's ``compute_capability`` and ``core_count``); the rest comes from spec-sheet tables, and stays
  ``None`` where the device is not in them.
* :func:`cdiv`, :func:`round_up`, :func:`next_power_of_2`: grid and padding arithmetic.
* :func:`fold_vmap`: the one way a kernel launcher takes ``jax.vmap`` -- the mapped axis folded into
  the kernel's own batch axis (one launch), or one launch per element where that would be wrong.

It lives at ``ejkernel.device`` rather than under ``ejkernel.ops``: kernels need it, the dispatch
layer (executor, config chain, caches) does not, and ``import ejkernel.ops`` loads all of that.

>>> import jax
>>> info = device_info(jax.devices("cpu")[0])
>>> info.platform, info.compute_capability, info.shared_memory_per_block
('cpu', None, None)
>>> cdiv(300, 128), round_up(300, 128), next_power_of_2(300)
(3, 384, 512)
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any, overload

import jax
import jax.numpy as jnp

__all__ = [
    "DeviceInfo",
    "cdiv",
    "device_info",
    "first_gpu",
    "fold_vmap",
    "next_power_of_2",
    "round_up",
    "shared_memory_per_block",
]

# ------------------------------------------------------------------------------------------------
# Index math.
# ------------------------------------------------------------------------------------------------


@overload
def cdiv(a: int, b: int) -> int: ...
@overload
def cdiv(a: jax.Array, b: int) -> jax.Array: ...
def cdiv(a: Any, b: int) -> Any:
    """``ceil(a / b)`` for a positive ``b``: Python ints, or jax arrays (traced, in kernels too).

    ``(a + (b - 1)) // b`` is exact for every integer ``a``, negative ones included (and adds one
    constant to an array, not two).

    >>> cdiv(7, 2), cdiv(8, 2), cdiv(0, 4), cdiv(-3, 2)
    (4, 4, 0, -1)
    """
    return (a + (b - 1)) // b


@overload
def round_up(x: int, m: int) -> int: ...
@overload
def round_up(x: jax.Array, m: int) -> jax.Array: ...
def round_up(x: Any, m: int) -> Any:
    """``x`` rounded up to a multiple of ``m`` (padding to whole blocks).

    >>> round_up(130, 64), round_up(128, 64)
    (192, 128)
    """
    return cdiv(x, m) * m


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``).

    >>> [next_power_of_2(n) for n in (0, 1, 2, 3, 64, 65)]
    [1, 1, 2, 4, 64, 128]
    """
    return 1 << max(0, int(n) - 1).bit_length()


# ------------------------------------------------------------------------------------------------
# Device facts.
# ------------------------------------------------------------------------------------------------

# Opt-in dynamic shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin), bytes, by compute
# capability: the CUDA programming guide's table. Triton and Mosaic GPU refuse a kernel that needs more.
_SMEM_PER_BLOCK: dict[tuple[int, int], int] = {
    (7, 0): 96 * 1024,
    (7, 2): 48 * 1024,
    (7, 5): 64 * 1024,
    (8, 0): 163 * 1024,
    (8, 6): 99 * 1024,
    (8, 7): 163 * 1024,
    (8, 9): 99 * 1024,
    (9, 0): 227 * 1024,
    (10, 0): 227 * 1024,
    (10, 3): 227 * 1024,
    (11, 0): 227 * 1024,
    (12, 0): 99 * 1024,
    (12, 1): 99 * 1024,
}
_SMEM_DEFAULT = 48 * 1024  # what every CUDA GPU gives a block without opting in

# Spec sheets by device kind (jax's ``device_kind``, matched lower-case, first hit wins, so more specific
# names come first): (SMs, HBM bytes/s, dense bf16 FLOP/s). None where not published or not meaningful.
_KIND_TABLE: tuple[tuple[tuple[str, ...], int | None, float | None, float | None], ...] = (
    (("gh200",), 132, 4.0e12, 989.4e12),
    (("h200",), 132, 4.8e12, 989.4e12),
    (("h100", "pcie"), 114, 2.0e12, 756.0e12),
    (("h100", "nvl"), 132, 3.9e12, 835.5e12),
    (("h100",), 132, 3.35e12, 989.4e12),  # SXM ("NVIDIA H100 80GB HBM3")
    (("h800",), 132, 3.35e12, 989.4e12),
    (("b200",), 148, 8.0e12, 2.25e15),
    (("a100", "40gb"), 108, 1.555e12, 312.0e12),
    (("a100", "pcie"), 108, 1.935e12, 312.0e12),
    (("a100",), 108, 2.039e12, 312.0e12),  # SXM4 80GB
    (("l40s",), 142, 0.864e12, 362.0e12),
    (("l4",), 58, 0.3e12, 121.0e12),
    (("v100",), 80, 0.9e12, None),  # no bf16
    (("tpu v6",), None, 1.64e12, 918.0e12),  # Trillium (v6e)
    (("tpu v5p",), None, 2.765e12, 459.0e12),
    (("tpu v5 lite",), None, 0.819e12, 197.0e12),  # v5e
    (("tpu v5e",), None, 0.819e12, 197.0e12),
    (("tpu v4",), None, 1.2e12, 275.0e12),
)


def shared_memory_per_block(capability: tuple[int, int] | int) -> int:
    """Opt-in shared memory per block, in bytes, of a CUDA compute capability: ``(9, 0)`` or Triton's ``90``.

    An unknown minor version takes its major's ``.0``; an unknown major the 48 KiB every GPU allows.

    >>> shared_memory_per_block((9, 0)) // 1024, shared_memory_per_block(80) // 1024
    (227, 163)
    """
    if isinstance(capability, int):
        capability = divmod(capability, 10)
    major, minor = capability
    return _SMEM_PER_BLOCK.get((major, minor), _SMEM_PER_BLOCK.get((major, 0), _SMEM_DEFAULT))


def _parse_capability(value: Any) -> tuple[int, int] | None:
    # jax reports a CUDA device's as "9.0"; ROCm's (a gfx name) and anything else is not one.
    m = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", str(value)) if value is not None else None
    return (int(m.group(1)), int(m.group(2))) if m else None


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """Facts about one device that kernels plan with. GPU fields are ``None`` off a GPU.

    >>> h100 = DeviceInfo.from_attributes("gpu", "NVIDIA H100 80GB HBM3", compute_capability="9.0")
    >>> h100.compute_capability, h100.sm_count, h100.shared_memory_per_block, h100.hbm_bandwidth
    ((9, 0), 132, 232448, 3350000000000.0)
    >>> h100.has_capability(9, 0), h100.has_capability(10, 0)
    (True, False)
    """

    platform: str  # jax's: "cpu", "gpu", "tpu"
    device_kind: str  # e.g. "NVIDIA H200", "TPU v5 lite", "cpu"
    compute_capability: tuple[int, int] | None = None  # NVIDIA GPUs only, e.g. (9, 0)
    sm_count: int | None = None  # streaming multiprocessors (NVIDIA GPUs)
    shared_memory_per_block: int | None = None  # bytes, the opt-in maximum (NVIDIA GPUs)
    hbm_bandwidth: float | None = None  # bytes/s, spec sheet
    peak_bf16_flops: float | None = None  # dense FLOP/s, spec sheet

    @classmethod
    def from_attributes(
        cls,
        platform: str,
        device_kind: str,
        *,
        compute_capability: Any = None,
        sm_count: int | None = None,
    ) -> DeviceInfo:
        """Build from what jax reports (``compute_capability`` as jax spells it, ``"9.0"``); the
        tables fill in the rest (and the SM count, when jax did not give it)."""
        cc = _parse_capability(compute_capability)
        kind = device_kind.lower()
        row = next((r for r in _KIND_TABLE if all(part in kind for part in r[0])), None)
        table_sms, bandwidth, flops = row[1:] if row is not None else (None, None, None)
        return cls(
            platform=platform,
            device_kind=device_kind,
            compute_capability=cc,
            sm_count=(sm_count or table_sms) if cc is not None else None,
            shared_memory_per_block=shared_memory_per_block(cc) if cc is not None else None,
            hbm_bandwidth=bandwidth,
            peak_bf16_flops=flops,
        )

    def has_capability(self, major: int, minor: int = 0) -> bool:
        """Whether this is an NVIDIA GPU of compute capability ``major.minor`` or newer."""
        return self.compute_capability is not None and self.compute_capability >= (major, minor)


@functools.cache
def _device_info(device: Any) -> DeviceInfo:
    sms = getattr(device, "core_count", None)
    return DeviceInfo.from_attributes(
        str(device.platform),
        str(device.device_kind),
        compute_capability=getattr(device, "compute_capability", None),
        sm_count=int(sms) if isinstance(sms, int) and sms > 0 else None,
    )


def device_info(device: Any = None) -> DeviceInfo:
    """:class:`DeviceInfo` of ``device`` (default: ``jax.devices()[0]``); cached per device.

    >>> device_info(jax.devices("cpu")[0]).sm_count is None
    True
    """
    return _device_info(jax.devices()[0] if device is None else device)


@functools.cache
def first_gpu() -> DeviceInfo | None:
    """:class:`DeviceInfo` of the first GPU, or ``None`` where jax sees none (cached).

    >>> first_gpu() is None or first_gpu().platform == "gpu"
    True
    """
    try:
        devices = jax.devices("gpu")
    except RuntimeError:  # no GPU backend
        return None
    return device_info(devices[0]) if devices else None


# ------------------------------------------------------------------------------------------------
# vmap: fold the mapped axis into the kernel's batch axis.
# ------------------------------------------------------------------------------------------------


def _is_none(x: Any) -> bool:
    return x is None


def _leaf_axes(axes: Any, tree: Any, what: str) -> list[int | None]:
    """One axis per array leaf of ``tree``, from ``axes``, a pytree prefix of it (like ``jax.vmap``'s)."""
    flat: list[int | None] = []

    def take(ax: Any, sub: Any) -> None:
        if ax is not None and not isinstance(ax, int):
            raise TypeError(f"fold_vmap: {what} entries must be an int or None, got {ax!r}")
        flat.extend([ax] * len(jax.tree.leaves(sub)))

    try:
        jax.tree.map(take, axes, tree, is_leaf=_is_none)
    except ValueError as e:
        raise ValueError(
            f"fold_vmap: {what} {axes!r} is not a prefix of the structure {jax.tree.structure(tree)}"
        ) from e
    return flat


def _fold(x: jax.Array, batched: bool, axis: int, size: int) -> jax.Array:
    """``x`` with the mapped axis (at 0 when ``batched``; else broadcast) merged into ``axis``: v*n + i."""
    if not batched:
        x = jnp.broadcast_to(x[None], (size, *x.shape))
    axis %= x.ndim - 1
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(*x.shape[:axis], x.shape[axis] * x.shape[axis + 1], *x.shape[axis + 2 :])


def _unfold(y: jax.Array, axis: int, size: int) -> jax.Array:
    axis %= y.ndim
    y = y.reshape(*y.shape[:axis], size, y.shape[axis] // size, *y.shape[axis + 1 :])
    return jnp.moveaxis(y, axis, 0)


def fold_vmap(fn: Callable[..., Any], in_axes: Any, out_axes: Any) -> Callable[..., Any]:
    """``fn`` (positional arguments) made to take ``jax.vmap`` by folding the mapped axis into a batch axis.

    ``in_axes`` has one entry per argument (or one for all), each a pytree prefix of it like
    ``jax.vmap``'s: the argument's batch axis, or ``None`` for one the whole batch shares (interval
    tables, a seed). ``out_axes`` likewise for the result. Under ``vmap`` of size ``V``, every argument
    with a batch axis of size ``n`` becomes ``V * n`` rows (mapped index ``v``, row ``i`` -> ``v * n + i``;
    an unmapped one is broadcast first), ``fn`` runs once, and each result's batch axis is split back.
    That is right only when ``fn`` treats batch rows independently. It cannot fold -- and runs ``fn``
    once per element (``lax.map``) instead -- when a mapped argument has axis ``None``, or ``out_axes``
    holds a ``None`` (a result that is not per row, e.g. a sum over the batch); so ``in_axes=None`` is
    the sequential rule. Nested ``vmap`` folds (or loops) once per level.

    >>> calls = []
    >>> def scale_rows(x, w):  # x [B, N], w [N]: a launcher written for one batch
    ...     calls.append(x.shape)
    ...     return x * w
    >>> f = fold_vmap(scale_rows, in_axes=(0, None), out_axes=0)
    >>> x, w = jnp.arange(24.0).reshape(2, 3, 4), jnp.arange(4.0)
    >>> bool((jax.vmap(f, in_axes=(0, None))(x, w) == x * w).all()), calls[-1]
    (True, (6, 4))
    >>> _ = jax.vmap(f)(x, jnp.ones((2, 4)))  # w mapped but shared (None): one call per element
    >>> calls[-1]
    (3, 4)
    """

    @jax.custom_batching.custom_vmap
    def call(*args: Any) -> Any:
        return fn(*args)

    @call.def_vmap
    def _rule(axis_size: int, in_batched: list[Any], *args: Any) -> tuple[Any, Any]:
        leaves, treedef = jax.tree.flatten(args)
        batched = jax.tree.leaves(in_batched)
        axes = _leaf_axes(in_axes, args, "in_axes")
        out_prefix = jax.tree.leaves(out_axes, is_leaf=_is_none)
        foldable = all(a is not None for a in out_prefix) and all(
            a is not None or not b for a, b in zip(axes, batched, strict=True)
        )
        if foldable:
            folded = [x if a is None else _fold(x, b, a, axis_size) for x, b, a in zip(leaves, batched, axes)]
            out = call(*jax.tree.unflatten(treedef, folded))
            out_leaves, out_tree = jax.tree.flatten(out)
            out_axes_flat = _leaf_axes(out_axes, out, "out_axes")  # all ints: checked by foldable
            out_leaves = [y if a is None else _unfold(y, a, axis_size) for y, a in zip(out_leaves, out_axes_flat)]
            out = jax.tree.unflatten(out_tree, out_leaves)
        else:

            def one(mapped: list[jax.Array]) -> Any:
                it = iter(mapped)
                return call(*jax.tree.unflatten(treedef, [next(it) if b else x for x, b in zip(leaves, batched)]))

            out = jax.lax.map(one, [x for x, b in zip(leaves, batched) if b])
        return out, jax.tree.map(lambda _: True, out)

    return call
