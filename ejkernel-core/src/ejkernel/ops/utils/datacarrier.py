"""``FwdParams`` and ``BwdParams`` (defined with the op signatures in ``ejkernel.kernels.params``, which use them)."""

from ejkernel.kernels.params import BwdParams, FwdParams

__all__ = ["BwdParams", "FwdParams"]
