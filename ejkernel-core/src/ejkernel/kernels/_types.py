"""Platforms (who wrote the kernel) and backends (where it runs)."""

from __future__ import annotations

import enum


class Platform(str, enum.Enum):
    """The kernel language of an implementation; third-party plugins may use any other string."""

    XLA = "xla"
    TRITON = "triton"
    PALLAS = "pallas"
    CUDA = "cuda"

    def __str__(self) -> str:
        return self.value


class Backend(str, enum.Enum):
    """The device kind an implementation runs on; ``ANY`` runs wherever JAX runs."""

    CPU = "cpu"
    GPU = "gpu"
    TPU = "tpu"
    ANY = "any"

    def __str__(self) -> str:
        return self.value


def normalize_backend(name: str) -> str:
    """Map JAX's platform names ("cuda", "rocm", "METAL", ...) to ours."""
    name = str(name).lower()
    if name in ("cuda", "rocm", "gpu"):
        return "gpu"
    return name


def check_backend(value: Backend | str, argument: str, *, auto: bool = True) -> str:
    """``value`` as one of our backend names (JAX's "cuda"/"rocm" mean "gpu"), else ``ValueError`` naming ``argument``.

    An unknown name would otherwise select only the ``any`` implementations, silently.
    """
    name = normalize_backend(getattr(value, "value", value))
    known = [b.value for b in Backend] + (["auto"] if auto else [])
    if name not in known:
        raise ValueError(f"{argument} must be one of {', '.join(map(repr, known))}, got {value!r}")
    return name


def current_backend() -> str:
    import jax

    return normalize_backend(jax.default_backend())
