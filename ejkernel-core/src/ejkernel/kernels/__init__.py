"""The op catalogue (``OPS``: each op's contract and canonical signature), ``Platform``, ``Backend`` and the ``kernel_registry``."""

from ejkernel.kernels._types import Backend, Platform
from ejkernel.kernels.registry import Implementation, KernelRegistry, kernel_registry
from ejkernel.kernels.signatures import OPS, check_signature

__all__ = ["OPS", "Backend", "Implementation", "KernelRegistry", "Platform", "check_signature", "kernel_registry"]
