"""The operations layer: ``Kernel``, ``Executor``, the config chain, caches, fingerprint and autotuner."""

from ejkernel.ops.call import Call
from ejkernel.ops.config.autotune import AutotuneError, Autotuner
from ejkernel.ops.config.base import BaseOperationConfig
from ejkernel.ops.config.chain import (
    ConfigError,
    ConfigSelectorChain,
    Selection,
    autotune_policy,
    current_overlay,
    default_chain,
    overlay,
)
from ejkernel.ops.config.fingerprint import device_fingerprint, fingerprint_id
from ejkernel.ops.config.persistent import CacheWarning, PersistentCache, cache_dir
from ejkernel.ops.core import Kernel
from ejkernel.ops.executor import Executor, recorded_invocations
from ejkernel.ops.invocation import Invocation
from ejkernel.ops.utils.datacarrier import BwdParams, FwdParams


def last_selections() -> list[Selection]:
    """The most recent selections of the default chain (newest last): what ran, with which params, and why."""
    return list(default_chain().history)


__all__ = [
    "AutotuneError",
    "Autotuner",
    "BaseOperationConfig",
    "BwdParams",
    "CacheWarning",
    "Call",
    "ConfigError",
    "ConfigSelectorChain",
    "Executor",
    "FwdParams",
    "Invocation",
    "Kernel",
    "PersistentCache",
    "Selection",
    "autotune_policy",
    "cache_dir",
    "current_overlay",
    "default_chain",
    "device_fingerprint",
    "fingerprint_id",
    "last_selections",
    "overlay",
    "recorded_invocations",
]
