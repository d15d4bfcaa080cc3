"""The config cache against hostile or careless files (issue 11): every fault injected on a real disk.

An export cannot write outside the cache directory; a bad export changes nothing; a cache file that
parses but holds bad entries, or does not decode, never breaks a call; ``cache clear`` copes with
strays.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ejkernel.ops import CacheWarning, PersistentCache


def ejkernel(*args: str, cache_dir: Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "EJKERNEL_CACHE_DIR": str(cache_dir)}
    return subprocess.run(
        [sys.executable, "-m", "ejkernel", *args], env=env, input=stdin, capture_output=True, text=True, timeout=300
    )


def ejkernel_here(*args: str, cache_dir: Path, monkeypatch, capsys, stdin: str | None = None):
    """The command in this process (the parametrized cases: a subprocess each costs seconds of imports)."""
    import io

    from ejkernel.cli import main

    monkeypatch.setenv("EJKERNEL_CACHE_DIR", str(cache_dir))
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def _export(*files: object) -> dict:
    return {"format": 1, "kind": "ejkernel-config-cache", "files": list(files)}


GOOD_ENTRY = {"impl": "xla:any", "params": {"q_blocksize": 64}, "seconds": 0.001}
GOOD_FILE = {"fingerprint_id": "cpu-0123456789", "op": "gla", "fingerprint": {}, "entries": {"fwd|k": GOOD_ENTRY}}


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its content: what 'nothing changed' compares."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# -- security: names from a file never leave the cache directory ------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("fingerprint_id", "../../escaped"),
        ("fingerprint_id", ".."),
        ("fingerprint_id", "/tmp/abs"),
        ("fingerprint_id", "a/b"),
        ("op", "../gla"),
        ("op", "..\\gla"),
        ("op", ""),
        ("op", 7),
        ("fingerprint_id", ".hidden"),
    ],
)
def test_cache_import_refuses_names_that_could_leave_the_cache(tmp_path, field, value, monkeypatch, capsys):
    cache = tmp_path / "home" / "cache"
    cache.mkdir(parents=True)
    victim = tmp_path / "home" / "escaped" / "gla.json"  # what "../../escaped" aimed at, relative to a file
    victim.parent.mkdir()
    victim.write_text('{"mine": true}')
    doc = tmp_path / "team.json"
    doc.write_text(json.dumps(_export({**GOOD_FILE, field: value})))
    before = _tree(tmp_path / "home")
    run = ejkernel_here("cache", "import", str(doc), cache_dir=cache, monkeypatch=monkeypatch, capsys=capsys)
    assert run.returncode == 2, run.stdout
    assert field in run.stderr and "nothing changed" in run.stderr and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
    assert _tree(tmp_path / "home") == before
    assert victim.read_text() == '{"mine": true}'


def test_cache_import_refuses_a_symlinked_fingerprint_directory(tmp_path):
    cache, outside = tmp_path / "cache", tmp_path / "outside"
    cache.mkdir()
    outside.mkdir()
    (cache / "cpu-0123456789").symlink_to(outside)
    with pytest.raises(ValueError, match="outside the cache directory"):
        PersistentCache(cache).import_(_export(GOOD_FILE))
    assert not any(outside.iterdir())


# -- cache import: validate the whole document, then all or nothing ---------------------------------


@pytest.mark.parametrize(
    "doc, needle",
    [
        (_export(), None),  # an empty export is fine: imports nothing
        ({**_export(), "files": {"a": 1}}, "'files' must be a list"),
        (_export(GOOD_FILE, "not a file"), "files[1] must be an object"),
        (_export(GOOD_FILE, {k: v for k, v in GOOD_FILE.items() if k != "fingerprint_id"}), "has no 'fingerprint_id'"),
        (_export(GOOD_FILE, {**GOOD_FILE, "op": "mla", "entries": []}), "files[1].entries must be an object"),
        (_export(GOOD_FILE, {**GOOD_FILE, "op": "mla", "entries": {"k": "x"}}), "an entry must be an object"),
        (_export({**GOOD_FILE, "entries": {"k": {"impl": 3}}}), "'impl' must be a non-empty string"),
        (_export({**GOOD_FILE, "entries": {"k": {**GOOD_ENTRY, "params": None}}}), "'params' must be an object"),
        (_export({**GOOD_FILE, "entries": {"k": {**GOOD_ENTRY, "seconds": "fast"}}}), "'seconds' must be"),
        (_export({**GOOD_FILE, "entries": {"k": {**GOOD_ENTRY, "params": {"a": [1]}}}}), "'params' values"),
        (_export({**GOOD_FILE, "fingerprint": ["x"]}), "fingerprint must be an object"),
        ([], "not an ejkernel cache export"),
    ],
)
def test_cache_import_checks_everything_before_writing_anything(tmp_path, doc, needle, monkeypatch, capsys):
    cache = tmp_path / "cache"
    PersistentCache(cache).put("cpu-0123456789", "gla", "old", GOOD_ENTRY, {})
    before = _tree(cache)
    run = ejkernel_here(
        "cache", "import", "-", cache_dir=cache, stdin=json.dumps(doc), monkeypatch=monkeypatch, capsys=capsys
    )
    if needle is None:
        assert run.returncode == 0 and "imported 0 entries" in run.stdout
        return
    assert run.returncode == 2, run.stdout
    assert needle in run.stderr and "nothing changed" in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
    assert _tree(cache) == before, "a refused import must not write a single file"


def test_cache_import_writes_every_file_of_a_good_export(tmp_path):
    cache = PersistentCache(tmp_path)
    cache.put("cpu-0123456789", "gla", "old", GOOD_ENTRY, {"device_kind": "cpu"})
    second = {**GOOD_FILE, "op": "flash_attention", "entries": {"a": GOOD_ENTRY, "b": {"impl": "triton:gpu"}}}
    assert cache.import_(_export(GOOD_FILE, second)) == 3
    fresh = PersistentCache(tmp_path)
    assert fresh.get("cpu-0123456789", "gla", "old") == GOOD_ENTRY, "import merges with what is there"
    assert fresh.get("cpu-0123456789", "gla", "fwd|k") == GOOD_ENTRY
    assert fresh.get("cpu-0123456789", "flash_attention", "b") == {"impl": "triton:gpu"}
    assert json.loads((tmp_path / "cpu-0123456789" / "gla.json").read_text())["fingerprint"] == {"device_kind": "cpu"}
    assert not list(tmp_path.rglob("*.tmp"))


# -- a bad file or entry never breaks a call --------------------------------------------------------


@pytest.mark.parametrize(
    "entry, problem",
    [
        ({"impl": "xla:any", "params": {"no_such_field": 1}}, "unknown field"),
        ({"impl": "xla:any", "params": {"q_blocksize": -4}}, "positive int"),
        ({"impl": "xla:any", "params": {}, "seconds": None}, None),  # valid: no timing recorded
        ("a string", "an entry must be an object"),
        ({"impl": "xla:any", "params": None}, "'params' must be an object"),
        ({"impl": "xla:any", "params": {}, "seconds": "slow"}, "'seconds' must be"),
    ],
)
def test_a_bad_entry_is_skipped_and_the_call_goes_on(isolated_cache, monkeypatch, entry, problem):
    """The entry sits under the exact key the call looks up: it is found, judged, and skipped or used."""
    import warnings

    import jax.numpy as jnp

    import ejkernel.ops as ops
    from ejkernel.modules import flash_attention

    q = jnp.ones((1, 8, 2, 16))
    monkeypatch.setenv("EJKERNEL_AUTOTUNE_POLICY", "autotune")
    flash_attention(q, q, q)  # writes the tuned entry under the key this call looks up
    (path,) = isolated_cache.glob("*/flash_attention.json")
    data = json.loads(path.read_text())
    (key,) = data["entries"]
    if isinstance(entry, dict):  # under the name of the implementation that won, so the lookup finds it
        entry = {**entry, "impl": data["entries"][key]["impl"]}
    data["entries"][key] = entry
    path.write_text(json.dumps(data))
    monkeypatch.setattr(ops.config.chain, "_default_chain", None)  # a new process's chain: nothing in memory
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert flash_attention(q, q, q).shape == (1, 8, 2, 16)
    tier = ops.last_selections()[-1].tier
    warned = " | ".join(str(w.message) for w in caught if issubclass(w.category, CacheWarning))
    after = json.loads(path.read_text())["entries"].get(key)
    if problem is None:
        assert tier == "persistent" and not warned
    else:
        assert tier == "autotune", "the bad entry is skipped: the next tier decides (and rewrites it)"
        assert problem in warned
        assert isinstance(after, dict) and after != entry, "the bad entry is replaced at the next write"


def test_non_utf8_cache_file_is_moved_aside_not_raised(tmp_path):
    path = tmp_path / "dev" / "op.json"
    path.parent.mkdir()
    path.write_bytes(b"\x00\xff\xfe\x80garbage")
    cache = PersistentCache(tmp_path)
    with pytest.warns(CacheWarning, match="is corrupt"):
        assert cache.get("dev", "op", "k") is None
    assert len(list(path.parent.glob("op.json.corrupt-*"))) == 1
    for command in (("cache", "list"), ("info",)):
        path.write_bytes(b"\x00\xff\xfe\x80garbage")
        run = ejkernel(*command, cache_dir=tmp_path)
        assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr


def test_bad_entries_are_dropped_at_the_next_write(tmp_path):
    path = tmp_path / "dev" / "op.json"
    path.parent.mkdir()
    entries = {"bad": {"impl": None}, "also": "x", "good": {"impl": "xla:any", "params": {}}}
    path.write_text(json.dumps({"format": 1, "fingerprint": {}, "op": "op", "entries": entries}))
    cache = PersistentCache(tmp_path)
    with pytest.warns(CacheWarning, match="skipping a bad entry"):
        assert cache.get("dev", "op", "bad") is None
    assert cache.get("dev", "op", "good") == {"impl": "xla:any", "params": {}}
    cache.put("dev", "op", "new", {"impl": "xla:any"}, {})
    assert sorted(json.loads(path.read_text())["entries"]) == ["good", "new"]


def test_put_refuses_a_malformed_entry_or_name(tmp_path):
    cache = PersistentCache(tmp_path)
    with pytest.raises(ValueError, match="'impl'"):
        cache.put("dev", "op", "k", {"params": {}}, {})
    with pytest.raises(ValueError, match="fingerprint_id"):
        cache.put("../x", "op", "k", {"impl": "a"}, {})
    assert not any(tmp_path.iterdir())


def test_cache_clear_with_a_directory_where_a_file_should_be(tmp_path):
    PersistentCache(tmp_path).put("dev", "gla", "k", {"impl": "xla:any"}, {})
    (tmp_path / "dev" / "flash_attention.json").mkdir()
    run = ejkernel("cache", "clear", cache_dir=tmp_path)
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    assert "removed 1 entries" in run.stdout and "flash_attention.json" in run.stderr
    assert not (tmp_path / "dev" / "gla.json").exists()
    for command in (("cache", "list"), ("info",), ("cache", "export", "-")):
        run = ejkernel(*command, cache_dir=tmp_path)
        assert run.returncode == 0 and "Traceback" not in run.stderr, (command, run.stderr)
