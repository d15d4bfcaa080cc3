"""ejkernel-pallas: Pallas kernels lowered by Mosaic, for TPUs and NVIDIA GPUs (none yet)."""

__version__ = "0.1.0"
