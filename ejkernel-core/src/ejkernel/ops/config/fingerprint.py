"""The device fingerprint: tuned configs are only reused on the same device kind and software stack."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import re
from typing import Any

# Distributions whose version changes what a kernel compiles to: (fingerprint key, names it installs under).
_DISTRIBUTIONS = (("triton", ("triton", "pytorch-triton")), ("jax_triton", ("jax-triton", "jax_triton")))
_NVIDIA_VERSION_FILE = "/proc/driver/nvidia/version"  # Linux: the NVIDIA kernel module's version


def _version(names: tuple[str, ...]) -> str | None:
    # The installed metadata, not an import: importing Triton takes seconds and is not needed here.
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _cuda_version(v: int) -> str:
    """CUDA's integer versions as text: 12080 -> ``12.8``."""
    return f"{v // 1000}.{v % 1000 // 10}"


def _cudnn_version(v: int) -> str:
    """cuDNN's: 91200 -> ``9.12.0`` (from 9 on), 8906 -> ``8.9.6`` (before)."""
    major, rest = (v // 10000, v % 10000) if v >= 90000 else (v // 1000, v % 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def _jaxlib_cuda_versions() -> Any:
    try:
        from jax._src.lib import cuda_versions  # jaxlib's CUDA plugin (None without one)

        return cuda_versions
    except Exception:  # a jax that moved it
        return None


def gpu_versions(dev: Any, cuda: Any = None) -> dict[str, str]:
    """The NVIDIA driver and CUDA library versions behind ``dev``; ``{}`` off an NVIDIA GPU.

    ``cuda`` is jaxlib's CUDA plugin version module (``jax._src.lib.cuda_versions``; found when ``None``).
    Each value is left out where it cannot be read, e.g. ``{"nvidia_driver": "580.159.03",
    "cuda_driver": "13.0", "cuda_runtime": "13.0", "cudnn": "9.12.0", "compute_capability": "9.0"}``.
    """
    if str(dev.platform) != "gpu" or "rocm" in str(getattr(dev.client, "platform_version", "")).lower():
        return {}
    out: dict[str, str] = {}
    try:
        with open(_NVIDIA_VERSION_FILE) as f:
            # "... Kernel Module  535.104.05  Sat Aug 19 ..." or "... Open Kernel Module for x86_64  580.159.04  ..."
            m = re.search(r"Kernel Module.*?\s(\d+(?:\.\d+)+)\s", f.read())
        if m:
            out["nvidia_driver"] = m.group(1)
    except OSError:
        pass
    if cuda is None:
        cuda = _jaxlib_cuda_versions()
    for key, getter, fmt in (
        ("cuda_driver", "cuda_driver_get_version", _cuda_version),
        ("cuda_runtime", "cuda_runtime_get_version", _cuda_version),
        ("cudnn", "cudnn_get_version", _cudnn_version),
    ):
        try:
            out[key] = fmt(int(getattr(cuda, getter)()))
        except Exception:  # absent in this jaxlib, or the call failed: leave it out
            pass
    if getattr(dev, "compute_capability", None):
        out["compute_capability"] = str(dev.compute_capability)
    return out


@functools.cache
def device_fingerprint() -> dict[str, str]:
    """The default device's kind, platform and platform version, and the software that compiles for it.

    jax and jaxlib always; Triton and jax-triton where installed; on an NVIDIA GPU also the driver and the
    CUDA runtime and cuDNN versions (:func:`gpu_versions`). Every value is text, read without running a kernel.
    """
    import jax
    import jaxlib

    dev = jax.devices()[0]
    try:
        platform_version = dev.client.platform_version
    except Exception:  # some PJRT plugins do not expose it
        platform_version = "unknown"
    fp = {
        "device_kind": str(dev.device_kind),
        "platform": str(dev.platform),
        "platform_version": str(platform_version),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
    }
    for key, names in _DISTRIBUTIONS:
        version = _version(names)
        if version is not None:
            fp[key] = version
    fp.update(gpu_versions(dev))
    return fp


@functools.cache
def fingerprint_id() -> str:
    """A short, file-name-safe id of :func:`device_fingerprint`, e.g. ``cpu-3f2a9c1b0d``."""
    fp = device_fingerprint()
    digest = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:10]
    kind = re.sub(r"[^A-Za-z0-9]+", "-", fp["device_kind"]).strip("-").lower() or "device"
    return f"{kind}-{digest}"


def stable_hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]
