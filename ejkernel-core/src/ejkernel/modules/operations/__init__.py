"""One module per op: its ``Kernel`` subclass and public function; the ``...Config`` dataclasses in ``configs``."""

from ejkernel.modules.operations.configs import *  # noqa: F403
from ejkernel.modules.operations.configs import __all__ as _configs
from ejkernel.modules.operations.flash_attention import FlashAttention, flash_attention

# (one import line per op above this line, sorted by op)

__all__ = [
    *_configs,
    "FlashAttention",
    "flash_attention",
    # (the op's Kernel class and function above this line)
]
