"""The persistent config cache on a real disk: concurrent writers, corrupt files, read-only directories."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from ejkernel.ops import CacheWarning, PersistentCache, fingerprint_id

FP = {"device_kind": "test"}


def _python(code: str, env: dict[str, str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
        **kw,
    )


def test_put_then_get_roundtrip_across_instances(tmp_path):
    PersistentCache(tmp_path).put("dev", "op", "k", {"impl": "xla:any", "params": {"q_blocksize": 64}}, FP)
    assert PersistentCache(tmp_path).get("dev", "op", "k") == {"impl": "xla:any", "params": {"q_blocksize": 64}}
    data = json.loads((tmp_path / "dev" / "op.json").read_text())
    assert data["format"] == 1 and data["fingerprint"] == FP and data["op"] == "op"


def test_two_processes_writing_at_once_lose_no_entry(tmp_path):
    code = """
        import sys
        from pathlib import Path
        from ejkernel.ops import PersistentCache
        cache = PersistentCache(Path(sys.argv[1]))
        for i in range(60):
            cache.put("dev", "flash_attention", f"{sys.argv[2]}-{i}", {"impl": "xla:any", "params": {"i": i}}, {})
    """
    procs = [
        subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), str(tmp_path), name]) for name in ("a", "b", "c")
    ]
    assert [p.wait(timeout=300) for p in procs] == [0, 0, 0]
    entries = json.loads((tmp_path / "dev" / "flash_attention.json").read_text())["entries"]
    assert sorted(entries) == sorted(f"{n}-{i}" for n in "abc" for i in range(60))
    assert not list((tmp_path / "dev").glob("*.tmp")), "temporary files must not be left behind"


@pytest.mark.parametrize(
    "content", ['{"format": 1, "entries": {"k": {"impl"', "\x00garbage\xff", '{"format": 99}', "[]"]
)
def test_corrupt_file_is_moved_aside_with_a_warning(tmp_path, content):
    path = tmp_path / "dev" / "op.json"
    path.parent.mkdir()
    path.write_text(content, errors="surrogateescape")
    cache = PersistentCache(tmp_path)
    with pytest.warns(CacheWarning, match="is corrupt"):
        assert cache.get("dev", "op", "k") is None
    aside = list(path.parent.glob("op.json.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_text(errors="surrogateescape") == content
    cache.put("dev", "op", "k", {"impl": "x"}, FP)  # the slot is usable again
    assert PersistentCache(tmp_path).get("dev", "op", "k") == {"impl": "x"}


def test_corrupt_cache_never_breaks_import_or_calls(tmp_path):
    env = {"EJKERNEL_CACHE_DIR": str(tmp_path), "EJKERNEL_AUTOTUNE_POLICY": "autotune", "PYTHONWARNINGS": "default"}
    fp = _python("import ejkernel.ops as o; print(o.fingerprint_id())", env).stdout.strip()
    (tmp_path / fp).mkdir(parents=True)
    (tmp_path / fp / "flash_attention.json").write_text('{"format": 1, "entries": {"trunc')
    run = _python(
        """
        from ejkernel.plugins import register_plugin
        from ejkernel.testing.reference_plugin import ReferencePlugin
        register_plugin(ReferencePlugin(), "reference")  # so that the core alone can run the call
        import jax.numpy as jnp, ejkernel
        from ejkernel.modules import flash_attention
        q = jnp.ones((1, 8, 2, 16))
        print(flash_attention(q, q, q).shape)
    """,
        env,
    )
    assert run.returncode == 0, run.stderr
    assert "(1, 8, 2, 16)" in run.stdout
    assert "is corrupt" in run.stderr and "moved aside" in run.stderr
    assert list((tmp_path / fp).glob("flash_attention.json.corrupt-*"))
    entries = json.loads((tmp_path / fp / "flash_attention.json").read_text())["entries"]
    assert entries, "the autotuned config is written to a fresh file"


def _read_only_runner(cache: Path) -> list[str] | None:
    """A command prefix under which ``cache`` is read-only: a read-only bind mount in a user namespace
    (root ignores permission bits), or plain ``chmod`` for an unprivileged user."""
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True) if shutil.which("unshare") else None
    if probe is not None and probe.returncode == 0:
        return [
            "unshare",
            "-rm",
            "sh",
            "-c",
            f'mount --bind "{cache}" "{cache}" && mount -o remount,bind,ro "{cache}" && exec "$0" "$@"',
        ]
    if os.geteuid() != 0:
        os.chmod(cache, 0o555)
        return []
    return None


def test_read_only_cache_dir_runs_on_and_warns_once(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    prefix = _read_only_runner(cache)
    if prefix is None:
        pytest.skip("running as root without user namespaces: no way to make a directory read-only here")
    code = """
        from ejkernel.plugins import register_plugin
        from ejkernel.testing.reference_plugin import ReferencePlugin
        register_plugin(ReferencePlugin(), "reference")  # so that the core alone can run the call
        import warnings, jax.numpy as jnp
        from ejkernel.modules import flash_attention
        from ejkernel.ops import CacheWarning
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for n in (8, 16, 24):  # three shapes: three autotune results that cannot be written
                q = jnp.ones((1, n, 2, 16))
                assert flash_attention(q, q, q).shape == (1, n, 2, 16)
        msgs = [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]
        print(len(msgs)); print(msgs[0] if msgs else "")
    """
    env = {**os.environ, "EJKERNEL_CACHE_DIR": str(cache), "EJKERNEL_AUTOTUNE_POLICY": "autotune"}
    run = subprocess.run(
        [*prefix, sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    count, message = run.stdout.strip().splitlines()
    assert count == "1" and "cannot write the config cache" in message
    assert not any(cache.iterdir())


def test_export_and_import_share_tuned_configs(tmp_path):
    src = PersistentCache(tmp_path / "a")
    src.put("dev", "flash_attention", "k1", {"impl": "triton:gpu", "params": {"q_blocksize": 128}}, FP)
    src.put("dev", "other_op", "k2", {"impl": "xla:any", "params": {}}, FP)
    doc = json.loads(json.dumps(src.export()))
    dst = PersistentCache(tmp_path / "b")
    assert dst.import_(doc) == 2
    assert dst.get("dev", "flash_attention", "k1")["params"] == {"q_blocksize": 128}
    assert sorted(p.name for p in dst.files()) == ["flash_attention.json", "other_op.json"]
    with pytest.raises(ValueError, match="not an ejkernel cache export"):
        dst.import_({"files": []})


def test_clear_removes_everything(tmp_path):
    cache = PersistentCache(tmp_path)
    cache.put("dev", "op", "k", {"impl": "x"}, FP)
    assert cache.clear() == 1
    assert cache.files() == [] and cache.get("dev", "op", "k") is None


def test_fingerprint_id_is_file_name_safe():
    fid = fingerprint_id()
    assert fid and all(c.isalnum() or c == "-" for c in fid)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fingerprint_id() == fid
