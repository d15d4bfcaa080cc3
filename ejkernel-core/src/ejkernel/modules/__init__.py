"""The public API: one function per op, with keyword-only options, ``cfg=`` and ``mesh``/``in_specs``/``out_specs``."""

from ejkernel.modules.operations import *  # noqa: F403
from ejkernel.modules.operations import __all__  # noqa: F401
from ejkernel.modules.operations.configs import *  # noqa: F403 - also here so that type checkers see the configs
