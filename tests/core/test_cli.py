"""The ``ejkernel`` command, run as a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ejkernel.ops import PersistentCache, fingerprint_id


def ejkernel(*args: str, cache_dir) -> subprocess.CompletedProcess:
    env = {**os.environ, "EJKERNEL_CACHE_DIR": str(cache_dir)}
    return subprocess.run(
        [sys.executable, "-m", "ejkernel", *args], env=env, capture_output=True, text=True, timeout=300
    )


def test_info_lists_versions_device_plugins_matrix_and_cache(isolated_cache):
    PersistentCache(isolated_cache).put(
        fingerprint_id(), "flash_attention", "fwd|k", {"impl": "xla:any", "params": {}}, {}
    )
    run = ejkernel("info", cache_dir=isolated_cache)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    for needle in (
        "ejkernel-core 0.1.0",
        "jax ",
        "device: ",
        f"fingerprint: {fingerprint_id()}",
        "autotune policy: heuristics",
        "plugins",
        "ops x platforms: the implementations by name",
        f"config cache: {isolated_cache}",
        "1 file(s), 1 entry",
    ):
        assert needle in out, (needle, out)


def test_info_json_is_the_same_report_as_data(isolated_cache):
    PersistentCache(isolated_cache).put(
        fingerprint_id(), "flash_attention", "fwd|k", {"impl": "xla:any", "params": {}}, {}
    )
    run = ejkernel("info", "--json", cache_dir=isolated_cache)
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    assert set(doc) == {"versions", "device", "fingerprint", "autotune_policy", "plugins", "ops", "cache"}
    assert doc["versions"]["ejkernel-core"] == "0.1.0" and doc["fingerprint"]["id"] == fingerprint_id()
    assert doc["cache"] == {"root": str(isolated_cache), "files": 1, "entries": 1}
    from ejkernel.kernels import OPS, kernel_registry

    assert set(doc["ops"]) == set(kernel_registry.algorithms()) <= set(OPS)
    for op, entry in doc["ops"].items():
        here = [i for i in entry["implementations"] if i["runs_here"]]
        assert entry["preferred"] == (max(here, key=lambda i: i["priority"])["name"] if here else None), op
    loaded = {p["name"] for p in doc["plugins"] if p["status"] == "loaded"}
    for p in doc["plugins"]:
        want = sum(i["plugin"] == p["name"] for e in doc["ops"].values() for i in e["implementations"])
        assert p["implementations"] == want, p
    if "xla" in loaded and doc["device"]["backend"] == "cpu":  # interpreted kernels register below XLA
        assert doc["ops"]["flash_attention"]["preferred"] == "xla"


def test_cache_export_clear_import_roundtrip(isolated_cache, tmp_path):
    cache = PersistentCache(isolated_cache)
    cache.put(
        "gpu-abc",
        "flash_attention",
        "fwd|k1",
        {"impl": "triton:gpu", "params": {"q_blocksize": 128}},
        {"device_kind": "H200"},
    )
    listed = ejkernel("cache", "list", cache_dir=isolated_cache)
    assert (
        "gpu-abc/flash_attention fwd: triton:gpu {'q_blocksize': 128}" in listed.stdout and "1 entry" in listed.stdout
    )
    exported = tmp_path / "team.json"
    assert ejkernel("cache", "export", str(exported), cache_dir=isolated_cache).returncode == 0
    assert json.loads(exported.read_text())["files"][0]["entries"]["fwd|k1"]["impl"] == "triton:gpu"
    assert "removed 1 entries" in ejkernel("cache", "clear", cache_dir=isolated_cache).stdout
    assert "0 entries" in ejkernel("cache", "list", cache_dir=isolated_cache).stdout
    assert "imported 1 entries" in ejkernel("cache", "import", str(exported), cache_dir=isolated_cache).stdout
    assert PersistentCache(isolated_cache).get("gpu-abc", "flash_attention", "fwd|k1")["params"] == {"q_blocksize": 128}


def test_cache_import_of_a_bad_file_fails_cleanly(isolated_cache, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    run = ejkernel("cache", "import", str(bad), cache_dir=isolated_cache)
    assert run.returncode == 2 and "cannot import" in run.stderr and "Traceback" not in run.stderr
    run = ejkernel("cache", "import", str(tmp_path / "missing.json"), cache_dir=isolated_cache)
    assert run.returncode == 2 and "missing.json" in run.stderr


def test_usage_errors_exit_2(isolated_cache):
    run = ejkernel("cache", "frobnicate", cache_dir=isolated_cache)
    assert run.returncode == 2 and "invalid choice" in run.stderr
