"""ejkernel-pallas: Pallas kernels lowered by Mosaic, for TPUs (`tpu`) and, later, NVIDIA GPUs (`gpu`)."""

__version__ = "0.1.0"
