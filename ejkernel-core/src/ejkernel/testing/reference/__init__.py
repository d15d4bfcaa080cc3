"""Reference implementations, one module per op: dense, float32 (float64 where enabled), written to be read.

They are the truth every backend is checked against, and depend on no backend. Each function
takes the op's canonical arguments (without the launch parameters ``fwd_params``/``bwd_params``).
"""

from ejkernel.testing.reference.flash_attention import attention_allowed, flash_attention

# (one import line per op above; keep them sorted by op)

__all__ = ["attention_allowed", "flash_attention"]
