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


def current_backend() -> str:
    import jax

    return normalize_backend(jax.default_backend())
