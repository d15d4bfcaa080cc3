"""The autotuner: time candidate configs on concrete inputs and keep the fastest.

Timing happens in a worker thread: JAX's tracing state is thread-local, so candidates run as real
computations on concrete arrays even when the op is being traced under ``jit``, ``grad`` or ``vmap``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax


@dataclasses.dataclass
class Timing:
    label: str
    seconds: float | None  # None: the candidate failed
    error: str | None = None


class AutotuneError(RuntimeError):
    """Every candidate failed."""


def _log_enabled() -> bool:
    return os.environ.get("EJKERNEL_LOG_AUTOTUNE", "") not in ("", "0", "false", "False")


class Autotuner:
    """Times each candidate ``warmup`` times untimed (compilation included), then ``iters`` times; keeps the median."""

    def __init__(self, warmup: int = 1, iters: int = 5) -> None:
        self.warmup = warmup
        self.iters = iters
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ejkernel-autotune")

    def time_one(self, fn: Callable[..., Any], args: Sequence[Any]) -> float:
        compiled = jax.jit(fn)
        for _ in range(self.warmup):
            jax.block_until_ready(compiled(*args))
        samples = []
        for _ in range(self.iters):
            start = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    def tune(
        self,
        title: str,
        candidates: Sequence[tuple[str, Callable[..., Any]]],
        make_args: Callable[[], Sequence[Any]],
    ) -> tuple[int, list[Timing]]:
        """Time every ``(label, fn)`` on ``make_args()``; return the index of the fastest and all timings.

        Raises:
            AutotuneError: every candidate failed (the message lists each failure).
        """
        return self._pool.submit(self._tune, title, candidates, make_args).result()

    def _tune(
        self, title: str, candidates: Sequence[tuple[str, Callable[..., Any]]], make_args: Callable[[], Sequence[Any]]
    ) -> tuple[int, list[Timing]]:
        args = make_args()
        log = _log_enabled()
        # A progress bar on a terminal when there is enough to wait for (each candidate compiles).
        progress = len(candidates) > 4 and sys.stderr.isatty()
        timings = []
        for n, (label, fn) in enumerate(candidates, 1):
            try:
                seconds: float | None = self.time_one(fn, args)
                error = None
            except Exception as e:  # a candidate that does not compile or run is skipped, and reported
                seconds, error = None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            timings.append(Timing(label, seconds, error))
            if log:
                what = f"{seconds * 1e3:9.3f} ms" if seconds is not None else f"failed: {error}"
                print(f"ejkernel autotune {title} [{n}/{len(candidates)}] {label}: {what}", file=sys.stderr)
            elif progress:
                done = n * 30 // len(candidates)
                end = "\n" if n == len(candidates) else ""
                print(
                    f"\rejkernel autotune {title} [{'#' * done}{'.' * (30 - done)}] {n}/{len(candidates)}",
                    end=end,
                    file=sys.stderr,
                    flush=True,
                )
        ok = [(t.seconds, i) for i, t in enumerate(timings) if t.seconds is not None]
        if not ok:
            raise AutotuneError(
                f"autotuning {title}: every candidate failed: " + "; ".join(f"{t.label}: {t.error}" for t in timings)
            )
        best = min(ok)[1]
        if log:
            print(f"ejkernel autotune {title}: chose {timings[best].label}", file=sys.stderr)
        return best, timings
