"""The persistent config cache: one JSON file per device fingerprint and op, safe across processes.

Layout: ``$EJKERNEL_CACHE_DIR/<fingerprint id>/<op>.json`` holding
``{"format": 1, "fingerprint": {...}, "op": ..., "entries": {key: entry}}``.

Writes take a file lock, merge with what is on disk (so concurrent writers lose nothing), write a
temporary file, fsync it and ``os.replace`` it over the old one. A file that cannot be parsed is
moved aside (``<op>.json.corrupt-<time>``) with a warning; a directory that cannot be written is
reported once and the process runs on with its in-memory cache.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import filelock

FORMAT = 1


class CacheWarning(UserWarning):
    """The persistent cache could not be read or written; calls go on without it."""


def cache_dir() -> Path:
    """``$EJKERNEL_CACHE_DIR``, else the platform's user cache directory (e.g. ``~/.cache/ejkernel``)."""
    env = os.environ.get("EJKERNEL_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("ejkernel", appauthor=False))


class PersistentCache:
    """Tuned configs on disk. ``get``/``put`` never raise for I/O or format problems: they warn and go on."""

    def __init__(self, root: Path | None = None) -> None:
        self._root = root
        self._lock = threading.Lock()
        self._loaded: dict[Path, dict[str, Any]] = {}
        self._warned: set[str] = set()

    @property
    def root(self) -> Path:
        return self._root if self._root is not None else cache_dir()

    def path(self, fingerprint_id: str, op: str) -> Path:
        return self.root / fingerprint_id / f"{op}.json"

    def _warn_once(self, tag: str, message: str) -> None:
        if tag not in self._warned:
            self._warned.add(tag)
            warnings.warn(message, CacheWarning, stacklevel=4)

    def _read(self, path: Path) -> dict[str, Any]:
        """The entries of ``path``; a corrupt file is moved aside and counts as empty."""
        try:
            text = path.read_text()
        except FileNotFoundError:
            return {}
        except OSError as e:
            self._warn_once(f"read:{path}", f"ejkernel: cannot read config cache {path}: {e}; going on without it")
            return {}
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
                raise ValueError(f"not an ejkernel cache file of format {FORMAT}")
            return data["entries"]
        except ValueError as e:
            aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
            try:
                os.replace(path, aside)
                where = f"moved aside to {aside}"
            except OSError as move_error:
                where = f"and could not be moved aside ({move_error})"
            warnings.warn(
                f"ejkernel: config cache {path} is corrupt ({e}); {where}; starting afresh", CacheWarning, stacklevel=4
            )
            return {}

    def get(self, fingerprint_id: str, op: str, key: str) -> dict[str, Any] | None:
        path = self.path(fingerprint_id, op)
        with self._lock:
            if path not in self._loaded:
                self._loaded[path] = self._read(path)
            return self._loaded[path].get(key)

    def put(self, fingerprint_id: str, op: str, key: str, entry: dict[str, Any], fingerprint: dict[str, str]) -> bool:
        """Merge one entry into the file under its lock; ``False`` (after one warning) when the disk refuses."""
        path = self.path(fingerprint_id, op)
        with self._lock:
            self._loaded.setdefault(path, {})[key] = entry
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                with filelock.FileLock(str(path) + ".lock", timeout=60):
                    entries = self._read(path)
                    entries[key] = entry
                    self._write(path, {"format": FORMAT, "fingerprint": fingerprint, "op": op, "entries": entries})
                    self._loaded[path] = entries
                return True
            except (OSError, filelock.Timeout) as e:
                self._warn_once(
                    f"write:{path.parent}",
                    f"ejkernel: cannot write the config cache under {path.parent} "
                    f"({e}); tuned configs stay in memory for this process",
                )
                return False

    @staticmethod
    def _write(path: Path, data: dict[str, Any]) -> None:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    # -- for the CLI -------------------------------------------------------------------------------

    def files(self) -> list[Path]:
        root = self.root
        return sorted(root.glob("*/*.json")) if root.is_dir() else []

    def entries(self) -> list[tuple[Path, str, dict[str, Any]]]:
        """Every ``(file, key, entry)`` on disk."""
        return [(p, k, e) for p in self.files() for k, e in sorted(self._read(p).items())]

    def clear(self) -> int:
        """Delete every cache file (and lock); returns how many entries went."""
        n = 0
        for path in self.files():
            with filelock.FileLock(str(path) + ".lock", timeout=60):
                n += len(self._read(path))
                path.unlink(missing_ok=True)
            Path(str(path) + ".lock").unlink(missing_ok=True)
        with self._lock:
            self._loaded.clear()
        return n

    def export(self) -> dict[str, Any]:
        """All files as one JSON-able document (for sharing tuned configs with a team)."""
        files = []
        for path in self.files():
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            files.append(
                {
                    "fingerprint_id": path.parent.name,
                    "op": path.stem,
                    "fingerprint": data.get("fingerprint", {}),
                    "entries": data.get("entries", {}),
                }
            )
        return {"format": FORMAT, "kind": "ejkernel-config-cache", "files": files}

    def import_(self, document: dict[str, Any]) -> int:
        """Merge an exported document into the cache; returns how many entries were written.

        Raises:
            ValueError: the document is not an ejkernel cache export.
        """
        if (
            not isinstance(document, dict)
            or document.get("kind") != "ejkernel-config-cache"
            or document.get("format") != FORMAT
        ):
            raise ValueError(f"not an ejkernel cache export of format {FORMAT} (expected keys 'kind' and 'format')")
        n = 0
        for f in document.get("files", []):
            for key, entry in f["entries"].items():
                if self.put(f["fingerprint_id"], f["op"], key, entry, f.get("fingerprint", {})):
                    n += 1
        return n
