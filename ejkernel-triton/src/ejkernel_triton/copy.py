"""A device copy in Triton: the memory-bandwidth ceiling the serving kernels are measured against.

``ejkernel bench`` times it beside ``page_attention`` and ``ragged_decode_attention`` as the peer ``triton-copy``:
copying the key cache reads and writes as many bytes as the op reads of keys and values, so the peer's TB/s (in
the op's bytes model) is what a plain copy reaches in the same run. (JAX's own ``x + 1`` is no ceiling: XLA
reached 2.3 TB/s with it on an H200, a torch copy 4.3.)
"""

from __future__ import annotations

import jax
import triton
import triton.language as tl

from ejkernel.device import cdiv

from ejkernel_triton import launch  # the interpreter switch, before any kernel is defined


@triton.jit
def _copy(X, n, Y, BLOCK: tl.constexpr):
    """``Y[i] = X[i]`` for the ``BLOCK`` elements of one program."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(Y + offs, tl.load(X + offs, mask=ok), mask=ok)


def device_copy(x: jax.Array, *, block: int = 8192, num_warps: int = 8) -> jax.Array:
    """A copy of ``x`` (any shape and dtype) by one Triton launch of ``cdiv(x.size, block)`` programs
    (``tests/triton/test_decode_interpret.py`` checks it in Triton's interpreter)."""
    flat = x.reshape(-1)
    (y,) = launch.launch(
        _copy,
        flat,
        int(flat.shape[0]),
        out_shape=(jax.ShapeDtypeStruct(flat.shape, flat.dtype),),
        grid=(cdiv(flat.shape[0], block),),
        num_warps=num_warps,
        num_stages=1,
        name="ejkernel_device_copy",
        BLOCK=block,
    )
    return y.reshape(x.shape)


__all__ = ["device_copy"]
