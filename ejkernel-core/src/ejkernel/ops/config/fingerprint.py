"""The device fingerprint: tuned configs are only reused on the same device kind and software stack."""

from __future__ import annotations

import functools
import hashlib
import json
import re
from typing import Any


@functools.cache
def device_fingerprint() -> dict[str, str]:
    """Device kind, platform, platform version and the jax/jaxlib versions of the default device."""
    import jax
    import jaxlib

    dev = jax.devices()[0]
    try:
        platform_version = dev.client.platform_version
    except Exception:  # some PJRT plugins do not expose it
        platform_version = "unknown"
    return {
        "device_kind": str(dev.device_kind),
        "platform": str(dev.platform),
        "platform_version": str(platform_version),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
    }


@functools.cache
def fingerprint_id() -> str:
    """A short, file-name-safe id of :func:`device_fingerprint`, e.g. ``cpu-3f2a9c1b0d``."""
    fp = device_fingerprint()
    digest = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:10]
    kind = re.sub(r"[^A-Za-z0-9]+", "-", fp["device_kind"]).strip("-").lower() or "device"
    return f"{kind}-{digest}"


def stable_hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]
