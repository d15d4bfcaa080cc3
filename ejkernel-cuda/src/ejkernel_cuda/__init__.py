"""ejkernel-cuda: native CUDA kernels called through XLA FFI (none yet)."""

__version__ = "0.1.0"
