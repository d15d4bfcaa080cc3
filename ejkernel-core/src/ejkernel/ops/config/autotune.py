"""The autotuner: time candidate configs on concrete inputs and keep the fastest.

Timing happens in a worker thread: JAX's tracing state is thread-local, so candidates run as real
computations on concrete arrays even when the op is being traced under ``jit``, ``grad`` or ``vmap``.
Each candidate is timed by :func:`ejkernel.ops.timing.measure`: its calls looped on the device in one
compiled program, so that a decode kernel of ~20 µs is timed, not its dispatch.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ejkernel.ops import timing
from ejkernel.ops.timing import Measurement


@dataclasses.dataclass
class Timing:
    label: str
    seconds: float | None  # None: the candidate failed
    error: str | None = None
    measurement: Measurement | None = None  # the samples behind ``seconds``: spread, calls per launch, method


class AutotuneError(RuntimeError):
    """Every candidate failed."""


def _log_enabled() -> bool:
    return os.environ.get("EJKERNEL_LOG_AUTOTUNE", "") not in ("", "0", "false", "False")


class Autotuner:
    """Times each candidate with :func:`ejkernel.ops.timing.measure`; keeps the one of least median time.

    ``budget_s`` bounds each candidate's timed device work (compilation aside): a slow candidate gets
    fewer samples, down to ``min_samples``; ``target_s`` is the device time of one timed launch.
    """

    def __init__(
        self,
        budget_s: float = timing.BUDGET_S,
        samples: int = timing.SAMPLES,
        min_samples: int = timing.MIN_SAMPLES,
        target_s: float = timing.TARGET_S,
    ) -> None:
        self.budget_s = budget_s
        self.samples = samples
        self.min_samples = min_samples
        self.target_s = target_s
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ejkernel-autotune")

    def measure(self, fn: Callable[..., Any], args: Sequence[Any]) -> Measurement:
        return timing.measure(
            fn,
            *args,
            target_s=self.target_s,
            samples=self.samples,
            min_samples=self.min_samples,
            budget_s=self.budget_s,
        )

    def time_one(self, fn: Callable[..., Any], args: Sequence[Any]) -> float:
        """Median seconds per call of ``fn(*args)``."""
        return self.measure(fn, args).seconds

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
            m: Measurement | None = None
            try:
                m = self.measure(fn, args)
                seconds: float | None = m.seconds
                error = None
            except Exception as e:  # a candidate that does not compile or run is skipped, and reported
                seconds, error = None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            timings.append(Timing(label, seconds, error, m))
            if log:
                if m is not None:
                    what = (
                        f"{m.seconds * 1e3:9.4f} ms (spread {m.spread:.1%}, {len(m.samples)} samples of "
                        f"{m.launches} x {m.calls} calls"
                        f"{', ' + m.note if m.note else ''})"
                    )
                else:
                    what = f"failed: {error}"
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
