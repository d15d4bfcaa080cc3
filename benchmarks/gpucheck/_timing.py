"""The wall-clock timer of the gpucheck scripts (quick comparisons of forms and plans; the recorded tables come from
``ejkernel bench``): the median of ``n`` samples after ``warmup`` calls, each sample ``reps`` calls ended by
``jax.block_until_ready``, in milliseconds per call. On the H200 it has a floor of about 0.15 ms a sample (an empty
``jit`` call; BENCHMARKS.md, sixth round): compare launches of similar length, not their ratio."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax


def median_ms(fn: Callable[..., Any], *args: Any, n: int = 20, warmup: int = 3, reps: int = 1) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / reps)
    return statistics.median(samples) * 1e3
