"""ejkernel-pallas: Pallas kernels lowered by Mosaic, for TPUs (`tpu`) and Hopper GPUs (`gpu`)."""

__version__ = "0.1.0"
