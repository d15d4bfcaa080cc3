"""Checks of one install configuration: which plugins load, and what they make available.

The nox sessions ``core``, ``xla``, ``triton``, ``pallas`` and ``cuda`` each install the core with
at most one plugin and set ``EJKERNEL_EXPECT_PLUGINS`` to the entry-point names that must load
(comma-separated; empty for the core alone). Without the variable this module is skipped: what
happens to be installed in a developer's environment is no contract.

The facts are read in a fresh interpreter (``python -c``), with ``EJKERNEL_PLUGINS`` and
``EJKERNEL_DISABLE_PLUGINS`` removed, so that in-test plugins registered by other tests of the same
run, and the caller's plugin filters, cannot change what is observed: only the installation does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

VARIABLE = "EJKERNEL_EXPECT_PLUGINS"

if VARIABLE not in os.environ:
    pytest.skip(
        f"{VARIABLE} is not set: these tests check the install configuration of one nox session (e.g. `nox -s xla`)",
        allow_module_level=True,
    )

EXPECTED = sorted({name.strip() for name in os.environ[VARIABLE].split(",") if name.strip()})

_PROBE = textwrap.dedent(
    """
    import json
    import warnings

    import jax.numpy as jnp

    from ejkernel.kernels import kernel_registry
    from ejkernel.plugins import plugin_records

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = plugin_records()
    report = {
        "records": [
            {
                "name": r.name,
                "distribution": r.distribution,
                "status": r.status,
                "error": r.error,
                "platforms": list(r.info.platforms) if r.info is not None else None,
                "reason": r.info.reason if r.info is not None and not r.info.available else None,
            }
            for r in records
        ],
        "warnings": [str(w.message) for w in caught],
        "implementations": [
            {"platform": i.platform, "backend": i.backend, "plugin": i.plugin}
            for i in kernel_registry.implementations("flash_attention", backend="all")
        ],
    }
    q = jnp.ones((1, 16, 4, 8), jnp.float32)
    kv = jnp.ones((1, 16, 2, 8), jnp.float32)
    try:
        from ejkernel.modules import flash_attention

        out = flash_attention(q, kv, kv, causal=True)
        report["call"] = {"shape": list(out.shape)}
    except Exception as e:
        report["call"] = {"error": type(e).__name__, "message": str(e)}
    print("EJKERNEL-PROBE " + json.dumps(report))
    """
)


def _clean_env() -> dict[str, str]:
    env = dict(os.environ)
    for name in ("EJKERNEL_PLUGINS", "EJKERNEL_DISABLE_PLUGINS", "EJKERNEL_STRICT_PLUGINS"):
        env.pop(name, None)
    return env


@pytest.fixture(scope="module")
def probe() -> dict[str, Any]:
    """What a fresh interpreter sees: plugin records, ``flash_attention`` implementations, one call."""
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, env=_clean_env(), timeout=300, check=False
    )
    assert proc.returncode == 0, f"the probe failed:\n{proc.stdout}\n{proc.stderr}"
    line = next(x for x in proc.stdout.splitlines() if x.startswith("EJKERNEL-PROBE "))
    return json.loads(line.removeprefix("EJKERNEL-PROBE "))


def test_exactly_the_expected_plugins_are_loaded(probe: dict[str, Any]) -> None:
    records = probe["records"]
    failed = {r["name"]: r["error"] for r in records if r["status"] == "failed"}
    assert not failed, f"plugins failed to load: {failed}"
    loaded = sorted(r["name"] for r in records if r["status"] == "loaded")
    assert loaded == EXPECTED, f"loaded plugins {loaded}, expected {EXPECTED} ({VARIABLE})"
    assert all(r["status"] == "loaded" for r in records), records


def test_loading_warns_about_nothing(probe: dict[str, Any]) -> None:
    assert probe["warnings"] == []


def test_each_plugin_describes_itself(probe: dict[str, Any]) -> None:
    for record in probe["records"]:
        assert record["distribution"] == f"ejkernel-{record['name']}", record
        assert record["platforms"], f"plugin {record['name']!r} declares no platform: {record}"


def test_implementations_come_only_from_the_expected_plugins(probe: dict[str, Any]) -> None:
    platforms = {r["name"]: set(r["platforms"] or ()) for r in probe["records"]}
    for impl in probe["implementations"]:
        assert impl["plugin"] in EXPECTED, f"{impl} comes from a plugin that should not be installed"
        assert impl["platform"] in platforms[impl["plugin"]], (
            f"{impl}: platform not among those its plugin declares ({sorted(platforms[impl['plugin']])})"
        )


@pytest.mark.skipif(bool(EXPECTED), reason="only the core alone lacks every implementation")
def test_without_plugins_a_call_says_what_to_install(probe: dict[str, Any]) -> None:
    assert probe["implementations"] == []
    call = probe["call"]
    assert "error" in call, f"flash_attention ran with no plugin installed: {call}"
    assert "no implementation" in call["message"].lower(), call
    assert "is installed" in call["message"], call
    assert "ejkernel-xla" in call["message"], call


@pytest.mark.skipif("xla" not in EXPECTED, reason="needs the XLA plugin, which runs on every device")
def test_with_xla_a_call_runs(probe: dict[str, Any]) -> None:
    assert probe["call"] == {"shape": [1, 16, 4, 8]}


def test_ejkernel_info_lists_the_expected_plugins(probe: dict[str, Any]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ejkernel", "info"],
        capture_output=True,
        text=True,
        env=_clean_env(),
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, f"`ejkernel info` exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    for name in EXPECTED:
        assert f"ejkernel-{name}" in proc.stdout, f"`ejkernel info` does not mention ejkernel-{name}:\n{proc.stdout}"
    for record in probe["records"]:
        if record["reason"]:  # a plugin that cannot run here says why
            assert record["reason"] in proc.stdout, (
                f"`ejkernel info` does not show {record['reason']!r}:\n{proc.stdout}"
            )
    if not EXPECTED:
        assert "ejkernel-xla" in proc.stdout, f"`ejkernel info` does not say what to install:\n{proc.stdout}"
