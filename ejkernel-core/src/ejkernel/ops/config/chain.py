"""The seven-tier configuration chain (docs/design.md §6): override, overlay, memory, persistent, autotune, heuristics, error.

``select`` resolves one stage of one call: ``"fwd"`` picks the implementation and its forward
parameters; when the call is differentiated, ``"train"`` picks them again by forward+backward time
(an implementation fastest forward may have a slow backward) and ``"bwd"`` then picks the backward
parameters of the implementation ``"train"`` chose. Each stage is tuned and cached on its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ejkernel.ops.config.autotune import AutotuneError, Autotuner, Timing
from ejkernel.ops.config.base import BaseOperationConfig
from ejkernel.ops.config.fingerprint import device_fingerprint, fingerprint_id, stable_hash
from ejkernel.ops.config.persistent import PersistentCache
from ejkernel.ops.invocation import Invocation
from ejkernel.ops.utils.datacarrier import BwdParams, FwdParams

if TYPE_CHECKING:
    from ejkernel.kernels.registry import Implementation
    from ejkernel.ops.core import Kernel

POLICIES = ("autotune", "heuristics", "error")
DEFAULT_POLICY = "heuristics"


class ConfigError(RuntimeError):
    """No tier of the chain produced a config (policy ``error``), or a forced choice cannot serve the call."""


def autotune_policy() -> str:
    """``EJKERNEL_AUTOTUNE_POLICY``, read at every call: ``autotune``, ``heuristics`` (default) or ``error``."""
    policy = os.environ.get("EJKERNEL_AUTOTUNE_POLICY", DEFAULT_POLICY).strip().lower() or DEFAULT_POLICY
    if policy not in POLICIES:
        raise ValueError(f"EJKERNEL_AUTOTUNE_POLICY must be one of {POLICIES}, got {policy!r}")
    return policy


# -- overlay --------------------------------------------------------------------------------------


def _make_overlay_state() -> Any:
    """A JAX config state (part of the jit cache key) when this JAX has one, else a thread-local stand-in."""
    try:
        from jax._src import config as jax_config

        return jax_config.string_or_object_state(
            "ejkernel_config_overlay",
            None,
            "ejkernel per-op config overlay",
            include_in_jit_key=True,
            include_in_trace_context=True,
        )
    except Exception:  # a JAX without this internal API: the overlay still works, minus jit re-tracing
        return None


_overlay_state = _make_overlay_state()
_overlay_local = threading.local()


def current_overlay() -> dict[str, BaseOperationConfig]:
    value = _overlay_state.value if _overlay_state is not None else getattr(_overlay_local, "value", None)
    return dict(value or ())


@contextlib.contextmanager
def overlay(configs: Mapping[str, BaseOperationConfig]) -> Iterator[None]:
    """Use ``configs`` (op name -> config) for calls inside the block; part of the jit cache key.

    >>> import ejkernel.ops as ops
    >>> from ejkernel.modules.operations.configs import FlashAttentionConfig
    >>> with ops.overlay({"flash_attention": FlashAttentionConfig(platform="xla")}):
    ...     ops.current_overlay()["flash_attention"].platform
    'xla'
    """
    for op, cfg in configs.items():
        if not isinstance(cfg, BaseOperationConfig):
            raise TypeError(f"overlay: the config for {op!r} must be a BaseOperationConfig, got {type(cfg).__name__}")
    merged = {**current_overlay(), **configs}
    value = tuple(sorted(merged.items()))
    if _overlay_state is not None:
        with _overlay_state(value):
            yield
    else:
        previous = getattr(_overlay_local, "value", None)
        _overlay_local.value = value
        try:
            yield
        finally:
            _overlay_local.value = previous


# -- selection ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Selection:
    """The outcome of one stage: which implementation, which params, which tier decided, and why."""

    op: str
    stage: str
    impl: Implementation
    params: FwdParams | BwdParams | None
    tier: str
    why: list[str]
    timings: list[Timing] = dataclasses.field(default_factory=list)

    def describe(self) -> str:
        params = self.params.to_dict() if self.params is not None else {}
        return (
            f"{self.op} {self.stage}: {self.impl.name} (from {self.impl.plugin}) {params} via {self.tier}; "
            + "; ".join(self.why)
        )


class ConfigSelectorChain:
    """Resolves configs through the seven tiers and keeps the memory cache; one per process by default."""

    def __init__(self, persistent: PersistentCache | None = None, autotuner: Autotuner | None = None) -> None:
        self.persistent = persistent if persistent is not None else PersistentCache()
        self.autotuner = autotuner if autotuner is not None else Autotuner()
        self.memory: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.history: list[Selection] = []
        self._lock = threading.RLock()

    def clear_memory(self) -> None:
        with self._lock:
            self.memory.clear()
            self.history.clear()

    def _remember(self, sel: Selection) -> Selection:
        with self._lock:
            self.history.append(sel)
            del self.history[:-64]
        return sel

    def select(
        self,
        kernel: Kernel[Any],
        inv: Invocation,
        stage: str,
        impls: Sequence[Implementation],
        *,
        override: BaseOperationConfig | None,
        forced: str | None,
        fwd: Selection | None = None,
        timing_fn: Callable[[Implementation, FwdParams | None, BwdParams | None], Callable[..., Any]] | None = None,
        make_args: Callable[[], Sequence[Any]] | None = None,
    ) -> Selection:
        """Resolve ``stage`` of ``inv`` among ``impls`` (already restricted to the platform/backend asked for).

        ``kernel`` supplies the heuristic and candidate launch parameters of each implementation.

        ``forced`` names what restricted ``impls`` (for error messages); ``fwd`` is the forward's
        selection when ``stage == "bwd"``; ``timing_fn(impl, fwd_params, bwd_params)`` builds the
        function the autotuner times on ``make_args()``. ``"train"`` is ``"fwd"`` timed as
        forward+backward (each implementation's backward at its heuristic parameters).
        """
        if stage not in ("fwd", "train", "bwd"):
            raise ValueError(f"stage must be 'fwd', 'train' or 'bwd', got {stage!r}")
        param_stage = "bwd" if stage == "bwd" else "fwd"  # what kind of launch parameters the stage picks
        why: list[str] = []
        if stage == "bwd":
            assert fwd is not None
            usable = [fwd.impl]
        else:
            usable = []
            for impl in impls:
                try:
                    reason = impl.supports(inv)
                    if reason is None:
                        impl.fn  # noqa: B018 - import now, so a broken plugin is skipped with its reason
                except Exception as e:
                    reason = f"{type(e).__name__}: {e}"
                if reason is None:
                    usable.append(impl)
                else:
                    why.append(f"skipped {impl.name}: {reason}")
            if not usable:
                raise ConfigError(self._nothing_serves(inv, impls, forced, why))

        # Tiers 1 and 2: the caller's config, or the overlay's.
        for tier, cfg in (("override", override), ("overlay", current_overlay().get(inv.op))):
            if cfg is None:
                continue
            # An implementation registered for "any" serves a config that names a backend.
            chosen = [
                i for i in usable if i.matches(cfg.platform) and (cfg.backend == "auto" or i.runs_on(cfg.backend))
            ]
            if any(i.name == cfg.platform for i in chosen):  # a name selects exactly that implementation
                chosen = [i for i in chosen if i.name == cfg.platform]
            if not chosen:
                raise ConfigError(
                    f"{inv.op}: the {tier} config asks for platform {cfg.platform!r}, backend {cfg.backend!r}, "
                    f"but no such implementation can serve {inv.describe()}: "
                    + ("; ".join(why) or f"available: {[i.name for i in usable]}")
                )
            impl = chosen[0]
            wanted = cfg.fwd_params if param_stage == "fwd" else cfg.bwd_params
            try:
                wanted = impl.coerce_params(wanted, param_stage)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"{inv.op}: the {tier} config's {param_stage}_params: {e}") from None
            params = wanted if wanted is not None else kernel.heuristic_cfg(inv, impl, param_stage)
            why.append(
                f"{tier} config"
                + ("" if wanted is not None else f" (its {param_stage}_params unset: {impl.name}'s heuristic)")
            )
            return self._remember(Selection(inv.op, stage, impl, params, tier, why))

        # Tiers 3 and 4: what was tuned before, in this process or on disk.
        by_name = {i.name: i for i in usable}
        if stage != "bwd":
            pool = ",".join(f"{i.name}@{i.version}" for i in usable)
        else:
            pool = f"{fwd.impl.name}@{fwd.impl.version}|{stable_hash(fwd.params.to_dict() if fwd.params else {})}"
        key = f"{stage}|{pool}|{inv.key()}"
        fp_id = fingerprint_id()
        mem_key = (fp_id, inv.op, key)
        for tier in ("memory", "persistent"):
            entry = self.memory.get(mem_key) if tier == "memory" else self.persistent.get(fp_id, inv.op, key)
            if entry is not None and entry.get("impl") in by_name:
                impl = by_name[entry["impl"]]
                try:
                    params = impl.params_type(param_stage).from_dict(entry.get("params", {}))
                except (TypeError, ValueError) as e:  # written by another version: a miss, never an error
                    if tier == "persistent":
                        self.persistent.discard(fp_id, inv.op, key, str(e))
                    self.memory.pop(mem_key, None)
                    continue
                if tier == "persistent":
                    self.memory[mem_key] = entry
                seconds = entry.get("seconds")
                why.append("tuned before" + (f" ({seconds * 1e3:.3f} ms)" if seconds is not None else ""))
                return self._remember(Selection(inv.op, stage, impl, params, tier, why))

        policy = autotune_policy()
        # Tier 5: time every candidate of every implementation that can serve the call.
        if policy == "autotune" and timing_fn is not None and make_args is not None:
            candidates: list[tuple[Implementation, Any]] = []
            for impl in usable:
                for params in kernel.candidate_cfgs(inv, impl, param_stage):
                    if (impl, params) not in candidates:
                        candidates.append((impl, params))
            if not candidates:
                # An op may offer nothing to time for some calls (e.g. collectives, which cannot run
                # outside their mesh); then the heuristic decides, and the explanation says why.
                why.append(f"autotune: {inv.op} offers no candidates to time for this call")
            else:

                def timed(impl: Implementation, params: Any) -> Callable[..., Any]:
                    if stage == "fwd":
                        return timing_fn(impl, params, None)
                    if stage == "train":
                        return timing_fn(impl, params, kernel.heuristic_cfg(inv, impl, "bwd"))
                    assert fwd is not None
                    return timing_fn(impl, fwd.params, params)

                labelled = [
                    (f"{impl.name} {params.to_dict() if params is not None else {}}", timed(impl, params))
                    for impl, params in candidates
                ]
                try:
                    best, timings = self.autotuner.tune(f"{inv.op} {stage}", labelled, make_args)
                except AutotuneError as e:
                    why.append(str(e))
                else:
                    impl, params = candidates[best]
                    entry = {
                        "impl": impl.name,
                        "impl_version": impl.version,
                        "params": params.to_dict() if params is not None else {},
                        "seconds": timings[best].seconds,
                        "invocation": inv.describe(),
                    }
                    self.memory[mem_key] = entry
                    self.persistent.put(fp_id, inv.op, key, entry, device_fingerprint())
                    failed = [t for t in timings if t.seconds is None]
                    why.append(
                        f"fastest of {len(timings)} candidates ({timings[best].seconds * 1e3:.3f} ms)"
                        + (
                            f"; {len(failed)} failed: " + "; ".join(f"{t.label}: {t.error}" for t in failed)
                            if failed
                            else ""
                        )
                    )
                    return self._remember(Selection(inv.op, stage, impl, params, "autotune", why, timings))

        # Tier 6: the best implementation's own heuristic.
        if policy != "error":
            impl = usable[0]
            why.append(f"{impl.name} has the highest priority ({impl.priority}) of {[i.name for i in usable]}")
            return self._remember(
                Selection(inv.op, stage, impl, kernel.heuristic_cfg(inv, impl, param_stage), "heuristics", why)
            )

        # Tier 7.
        raise ConfigError(
            f"{inv.op}: no config for {inv.describe()} on {fp_id} ({stage}): no override, no overlay entry, "
            f"nothing in the memory or persistent cache ({self.persistent.path(fp_id, inv.op)}), and "
            f"EJKERNEL_AUTOTUNE_POLICY=error forbids autotuning and heuristics. "
            + ("; ".join(why) + ". " if why else "")
            + "Tune once with EJKERNEL_AUTOTUNE_POLICY=autotune, import a shared cache (`ejkernel cache import`), or pass cfg=."
        )

    @staticmethod
    def _nothing_serves(inv: Invocation, impls: Sequence[Implementation], forced: str | None, why: list[str]) -> str:
        if not impls:
            from ejkernel.kernels.registry import kernel_registry

            return kernel_registry.explain_missing(inv.op, forced, inv.backend)
        head = f"{inv.op}: " + (f"{forced} cannot serve" if forced else "no installed implementation can serve")
        return f"{head} {inv.describe()}: " + "; ".join(why)


_default_chain: ConfigSelectorChain | None = None


def default_chain() -> ConfigSelectorChain:
    global _default_chain
    if _default_chain is None:
        _default_chain = ConfigSelectorChain()
    return _default_chain
