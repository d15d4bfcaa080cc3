"""The one timer of ejkernel: seconds per call of a function, measured so that a ~20 µs kernel is repeatable.

A host clock around one call measures dispatch and synchronisation (~100 µs on a GPU) as much as the
kernel. So :func:`measure` compiles one program that calls the function ``calls`` times in a
``lax.fori_loop`` (about ``launch_s`` of device work: the host dispatches the next launch meanwhile), and
one sample is a burst of ``launches`` back-to-back launches (about ``target_s``) minus one launch alone,
divided by the calls in between: the fixed cost of starting and synchronising cancels out. It reports
the median of up to ``samples`` samples (and their min and interquartile range), as many as ``budget_s``
of device work allows but at least ``min_samples``. A slow function (one call over ``target_s``) is timed
call by call; one that cannot run inside a loop is timed in bursts of single calls.

    >>> import jax.numpy as jnp
    >>> x, w = jnp.ones((8, 256)), jnp.ones((256, 512))
    >>> m = measure(lambda x, w: x @ w, x, w)
    >>> m.seconds > 0, m.method
    (True, 'loop')

(On an H200, ``x [8, 4096] @ w [4096, 14336]`` in bf16 measures 3.1e-05 s, repeatable within 2.4% across
processes; a host clock around single calls says ~120-340 µs.)

Limits: each loop iteration is still launched by the host, so a kernel shorter than that (~7 µs a call on
an H200 machine) is timed at the host's pace; and every call reads the same inputs, so inputs that fit in
the cache are timed cache-warm.

The autotuner (``ejkernel.ops.config.autotune``) and the benchmark scripts all time with this module. It
imports nothing of ejkernel, so a benchmark can load it by path next to another ejkernel release.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

TARGET_S = 6e-3  # device time of one sample (a burst of launches)
LAUNCH_S = 2e-3  # device time of one launch of the loop: a launch's own costs (~10-40 µs) are ~1% of it
SAMPLES = 25  # the most samples taken
MIN_SAMPLES = 3  # the fewest, whatever the budget
BUDGET_S = 0.5  # device time of the samples of one function (a slow one gets fewer)
WARMUP_S = 0.02  # untimed launches first, so that clocks and caches are up (an idle GPU runs at low clocks)
MAX_CALLS = 10_000  # calls in one loop
MAX_LAUNCHES = 64  # launches in one burst


@dataclasses.dataclass(frozen=True)
class Measurement:
    """Seconds per call: the median of ``samples`` (each over bursts of ``launches`` launches of ``calls`` calls).

    ``method`` is ``"loop"`` (``calls`` calls looped in one compiled program) or ``"calls"`` (one call a
    launch: a function slow enough not to need the loop, or one that failed in it, ``note`` says why).
    """

    seconds: float
    min: float
    iqr: float
    samples: tuple[float, ...]
    calls: int
    launches: int
    method: str
    note: str | None = None

    @property
    def spread(self) -> float:
        """The interquartile range relative to the median (0.02: the middle half of the samples is within 2%)."""
        return self.iqr / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        out["samples"] = list(self.samples)
        out["spread"] = self.spread
        return out


def summarize(
    per_call: Sequence[float], calls: int = 1, launches: int = 1, method: str = "calls", note: str | None = None
) -> Measurement:
    """A :class:`Measurement` of samples in seconds per call."""
    s = sorted(per_call)
    q1, _, q3 = statistics.quantiles(s, n=4, method="inclusive") if len(s) > 1 else (s[0], s[0], s[0])
    return Measurement(statistics.median(s), s[0], q3 - q1, tuple(per_call), calls, launches, method, note)


def repeat(fn: Callable[..., Any], calls: int, out_shape: Any) -> Callable[..., Any]:
    """``fn`` called ``calls`` times in a ``lax.fori_loop``; returns the last call's output.

    ``out_shape`` is ``jax.eval_shape(fn, *args)`` (the loop carries the output from an all-zero start).
    Each call's inputs pass, with the previous call's output, through ``lax.optimization_barrier``: XLA
    can then neither hoist the calls (or any part of them) out of the loop as loop-invariant nor drop the
    earlier calls, while the values the function sees are its inputs, unchanged and uncopied.
    """

    def looped(*args: Any) -> Any:
        def body(_: Any, carry: Any) -> Any:
            # The barrier's output must feed the carry: with only the function reading it, XLA prunes the
            # unused half of the barrier and the inputs become loop-invariant again.
            inputs, _previous = lax.optimization_barrier(carry)
            return inputs, fn(*inputs)

        start = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape)
        return lax.fori_loop(0, calls, body, (args, start))[1]

    return looped


def _burst(compiled: Callable[..., Any], args: Sequence[Any], launches: int) -> float:
    """Seconds of ``launches`` back-to-back launches and one sync (the device runs them in order)."""
    start = time.perf_counter()
    for _ in range(launches):
        out = compiled(*args)  # only the last output is held: the earlier ones are freed as they finish
    jax.block_until_ready(out)
    return time.perf_counter() - start


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


@dataclasses.dataclass
class Runner:
    """A compiled, calibrated function: :meth:`sample` gives one sample in seconds per call.

    With ``launches > 1`` a sample is ``(burst - single) / ((launches - 1) * calls)``: a burst of
    ``launches`` launches minus one launch alone, which cancels the fixed cost of a launch and its sync.
    For benchmarks that take turns over several functions (so that drift touches them alike);
    :func:`measure` is the usual entry point.
    """

    compiled: Callable[..., Any]
    args: tuple[Any, ...]
    calls: int
    launches: int
    method: str
    note: str | None = None
    last_s: float = 0.0  # the last sample's wall time

    def sample(self) -> float:
        if self.launches == 1:
            self.last_s = _burst(self.compiled, self.args, 1)
            return self.last_s / self.calls
        burst = _burst(self.compiled, self.args, self.launches)
        single = _burst(self.compiled, self.args, 1)
        self.last_s = burst + single
        if burst <= single:  # a hiccup in the single launch: the burst's mean is the better bound
            return burst / (self.launches * self.calls)
        return (burst - single) / ((self.launches - 1) * self.calls)

    def warm(self, seconds: float = WARMUP_S) -> None:
        """Sample untimed until ``seconds`` have passed, the last sample taken included."""
        end = time.perf_counter() + seconds - self.last_s
        while time.perf_counter() < end:
            self.sample()

    def measure(
        self, samples: int = SAMPLES, min_samples: int = MIN_SAMPLES, budget_s: float = BUDGET_S
    ) -> Measurement:
        """As many samples as ``budget_s`` allows, between ``min_samples`` and ``samples``."""
        n = max(min_samples, min(samples, int(budget_s / max(self.last_s, 1e-9))))
        return summarize([self.sample() for _ in range(n)], self.calls, self.launches, self.method, self.note)


def prepare(
    fn: Callable[..., Any],
    *args: Any,
    target_s: float = TARGET_S,
    launch_s: float = LAUNCH_S,
    max_calls: int = MAX_CALLS,
    loop: bool = True,
) -> Runner:
    """Compile ``fn`` (under ``jax.jit`` unless jitted) for ``args``, then a loop of as many calls as fill ``launch_s``.

    Errors of ``fn`` itself (it does not trace, compile or run) propagate; a loop that fails falls back
    to bursts of single calls, with the reason in ``note``.
    """
    once = fn if hasattr(fn, "lower") else jax.jit(fn)  # already jitted: its compiled program is reused
    _burst(once, args, 1)  # compiles and runs once: the function's own errors surface here
    first = _burst(once, args, 1)  # warm, and an upper bound: dispatch and sync included
    if target_s <= first < 4 * target_s:  # a slow function, or a hiccup: a second look decides
        first = min(first, _burst(once, args, 1))
    if first >= target_s:  # the fixed costs are a few % of one call: call by call
        return Runner(once, args, 1, 1, "calls", last_s=first)
    # Back-to-back calls, one sync: the host dispatches ahead of the device, so this is near the device
    # time unless dispatch is the slower (a kernel of tens of µs: the loop's first samples tell).
    k = max(2, min(MAX_LAUNCHES, int(target_s / first)))
    estimate = min(first, _burst(once, args, k) / k)
    if estimate >= launch_s or not loop or max_calls < 2:
        return Runner(once, args, 1, _launches(target_s, estimate), "calls", last_s=first)
    try:
        out_shape = jax.eval_shape(fn, *args)
        runner = _looped(fn, args, out_shape, max(2, min(max_calls, math.ceil(launch_s / estimate))), target_s)
        per_call = min(runner.sample(), runner.sample())
        if runner.calls * per_call < launch_s / 2 and runner.calls < max_calls:
            # The estimate was dispatch-bound (a kernel of tens of µs): size the loop by what the loop
            # measured, growing it at most 16x (a sample spoilt by a hiccup cannot make a launch of seconds).
            calls = min(max_calls, 16 * runner.calls, math.ceil(launch_s / max(per_call, 1e-9)))
            runner = _looped(fn, args, out_shape, calls, target_s)
    except Exception as e:  # e.g. an op that cannot run inside a loop on this backend
        note = f"timed in bursts of single calls: the loop failed: {_first_line(e)}"
        return Runner(once, args, 1, _launches(target_s, estimate), "calls", note, last_s=first)
    return runner


def _looped(fn: Callable[..., Any], args: tuple[Any, ...], out_shape: Any, calls: int, target_s: float) -> Runner:
    looped = jax.jit(repeat(fn, calls, out_shape))
    _burst(looped, args, 1)  # compiles
    one = min(_burst(looped, args, 1) for _ in range(2))
    return Runner(looped, args, calls, _launches(target_s, one), "loop", last_s=one)


def _launches(target_s: float, launch: float) -> int:
    return max(2, min(MAX_LAUNCHES, math.ceil(target_s / max(launch, 1e-9))))


def measure(
    fn: Callable[..., Any],
    *args: Any,
    target_s: float = TARGET_S,
    launch_s: float = LAUNCH_S,
    samples: int = SAMPLES,
    min_samples: int = MIN_SAMPLES,
    budget_s: float = BUDGET_S,
    warmup_s: float = WARMUP_S,
    max_calls: int = MAX_CALLS,
    loop: bool = True,
) -> Measurement:
    """Time ``fn(*args)`` on the device: see the module docstring.

    ``fn`` may return any pytree, and may be a forward+backward (``jax.vjp``/``jax.grad``) function; it is
    jitted here if it is not already. Compilation and warm-up are not counted in ``budget_s``.
    """
    runner = prepare(fn, *args, target_s=target_s, launch_s=launch_s, max_calls=max_calls, loop=loop)
    runner.warm(warmup_s)
    return runner.measure(samples, min_samples, budget_s)


def time_fn(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> float:
    """Median seconds per call of ``fn(*args)``: ``measure(fn, *args, **kwargs).seconds``."""
    return measure(fn, *args, **kwargs).seconds
