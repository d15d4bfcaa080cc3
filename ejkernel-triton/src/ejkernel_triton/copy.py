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
def _copy(X, Y, N: tl.constexpr, BLOCK: tl.constexpr):
    """``Y[i] = X[i]`` for the ``BLOCK`` elements of one program. ``N`` is a compile-time constant: a runtime
    bound (jax-triton passes scalars without divisibility hints) made the masked accesses element-wise, which
    held a bfloat16 copy to ~1 TB/s on an H200; only the last program is masked."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if N % BLOCK == 0:
        tl.store(Y + offs, tl.load(X + offs))
    else:
        ok = offs < N
        tl.store(Y + offs, tl.load(X + offs, mask=ok), mask=ok)


def device_copy(x: jax.Array, *, size: int | None = None, block: int = 8192, num_warps: int = 8) -> jax.Array:
    """A copy of ``x`` (any shape and dtype) by one Triton launch of ``cdiv(x.size, block)`` programs; with
    ``size``, of its first ``size`` elements (flat, ``[size]``) (``tests/triton/test_decode_interpret.py`` checks
    it in Triton's interpreter)."""
    flat = x.reshape(-1)
    n = flat.shape[0] if size is None else size
    if not 0 < n <= flat.shape[0]:
        raise ValueError(f"device_copy: size must be in [1, {flat.shape[0]}] (the elements of x), got {size}")
    (y,) = launch.launch(
        _copy,
        flat,
        out_shape=(jax.ShapeDtypeStruct((n,), flat.dtype),),
        grid=(cdiv(n, block),),
        num_warps=num_warps,
        num_stages=1,
        name="ejkernel_device_copy",
        N=n,
        BLOCK=block,
    )
    return y.reshape(x.shape) if size is None else y


__all__ = ["device_copy"]
