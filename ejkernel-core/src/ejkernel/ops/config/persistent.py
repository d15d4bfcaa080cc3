"""The persistent config cache: one JSON file per device fingerprint and op, safe across processes.

Layout: ``$EJKERNEL_CACHE_DIR/<fingerprint id>/<op>.json`` holding
``{"format": 1, "fingerprint": {...}, "op": ..., "entries": {key: entry}}``.

Writes take a file lock, merge with what is on disk (so concurrent writers lose nothing), write a
temporary file, fsync it and ``os.replace`` it over the old one. A file that cannot be decoded or parsed
is moved aside (``<op>.json.corrupt-<time>``) with a warning; an entry of the wrong shape is skipped with
one warning and dropped at the next write; a directory that cannot be written is reported once and the
process runs on with its in-memory cache. Nothing about the cache's contents ever makes a call raise.

Names that become path components (the fingerprint id and the op) must match :data:`NAME_PATTERN` and
stay inside the cache directory: an imported document cannot write anywhere else.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import filelock

FORMAT = 1
# A fingerprint id (``nvidia-h200-3f2a9c1b0d``) or an op name (``flash_attention``): no separators, no dots
# first, so that neither can name a path outside the cache directory.
NAME_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,127}")


def check_name(what: str, name: object) -> str:
    """``name`` if it is a safe path component (:data:`NAME_PATTERN`), else ``ValueError`` naming ``what``."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ValueError(f"{what} must match {NAME_PATTERN.pattern} (letters, digits, '_' and '-'), got {name!r}")
    return name


def entry_problem(entry: object) -> str | None:
    """Why ``entry`` is not a cache entry, or ``None``: a dict with a string ``impl``, a dict ``params``
    (may be absent), a non-negative ``seconds`` (may be absent or null) and string metadata."""
    if not isinstance(entry, dict):
        return f"an entry must be an object, got {type(entry).__name__}"
    if not isinstance(entry.get("impl"), str) or not entry["impl"]:
        return f"'impl' must be a non-empty string, got {entry.get('impl')!r}"
    params = entry.get("params", {})
    if not isinstance(params, dict) or not all(isinstance(k, str) for k in params):
        return f"'params' must be an object, got {params!r}"
    bad = {k: v for k, v in params.items() if not (v is None or isinstance(v, bool | int | float | str))}
    if bad:
        return f"'params' values must be numbers, strings, booleans or null, got {bad!r}"
    seconds = entry.get("seconds")
    if seconds is not None and (
        isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 <= seconds < float("inf")
    ):
        return f"'seconds' must be a non-negative number or null, got {seconds!r}"
    for meta in ("impl_version", "invocation"):
        if meta in entry and not isinstance(entry[meta], str):
            return f"{meta!r} must be a string, got {entry[meta]!r}"
    return None


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
        """``<root>/<fingerprint_id>/<op>.json``; ``ValueError`` for a name that could leave the root."""
        root = self.root
        path = root / check_name("fingerprint_id", fingerprint_id) / f"{check_name('op', op)}.json"
        if not path.resolve().is_relative_to(root.resolve()):  # e.g. the fingerprint directory is a symlink
            raise ValueError(f"cache file {path} resolves outside the cache directory {root}")
        return path

    def _warn_once(self, tag: str, message: str) -> None:
        if tag not in self._warned:
            self._warned.add(tag)
            warnings.warn(message, CacheWarning, stacklevel=4)

    def _read(self, path: Path) -> dict[str, Any]:
        """The well-formed entries of ``path``; a corrupt file is moved aside and counts as empty."""
        return self._read_file(path)[0]

    def _read_file(self, path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(entries, fingerprint)`` of ``path``, as :meth:`_read`."""
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return {}, {}
        except OSError as e:  # also a directory where the file should be
            self._warn_once(f"read:{path}", f"ejkernel: cannot read config cache {path}: {e}; going on without it")
            return {}, {}
        try:
            data = json.loads(raw.decode("utf-8"))  # UnicodeDecodeError is a ValueError: corrupt too
            if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
                raise ValueError(f"not an ejkernel cache file of format {FORMAT}")
            fingerprint = data.get("fingerprint")
            return self._valid_entries(path, data["entries"]), fingerprint if isinstance(fingerprint, dict) else {}
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
            return {}, {}

    def _valid_entries(self, path: Path, entries: dict[str, Any]) -> dict[str, Any]:
        """The well-formed entries; each bad one is warned about once (and so dropped at the next write)."""
        good = {}
        for key, entry in entries.items():
            problem = entry_problem(entry)
            if problem is None:
                good[key] = entry
            else:
                self._warn_once(
                    f"entry:{path}:{key}",
                    f"ejkernel: skipping a bad entry {key!r} in config cache {path} ({problem}); "
                    "it is dropped at the next write",
                )
        return good

    def discard(self, fingerprint_id: str, op: str, key: str, reason: str) -> None:
        """Drop an entry its reader cannot use (e.g. params of a class that has no such field), with one warning."""
        path = self.path(fingerprint_id, op)
        self._warn_once(f"entry:{path}:{key}", f"ejkernel: dropping entry {key!r} of config cache {path}: {reason}")
        with self._lock:
            self._loaded.get(path, {}).pop(key, None)
            try:
                with filelock.FileLock(str(path) + ".lock", timeout=60):
                    entries, fingerprint = self._read_file(path)
                    if key in entries:
                        del entries[key]
                        self._write(path, {"format": FORMAT, "fingerprint": fingerprint, "op": op, "entries": entries})
            except (OSError, filelock.Timeout):
                pass  # read-only: the entry stays skipped in this process

    def get(self, fingerprint_id: str, op: str, key: str) -> dict[str, Any] | None:
        path = self.path(fingerprint_id, op)
        with self._lock:
            if path not in self._loaded:
                self._loaded[path] = self._read(path)
            return self._loaded[path].get(key)

    def put(self, fingerprint_id: str, op: str, key: str, entry: dict[str, Any], fingerprint: dict[str, str]) -> bool:
        """Merge one entry into the file under its lock; ``False`` (after one warning) when the disk refuses.

        Raises:
            ValueError: ``entry`` is malformed (:func:`entry_problem`) or a name is unsafe (:func:`check_name`).
        """
        problem = entry_problem(entry)
        if problem is not None:
            raise ValueError(f"cache entry {key!r}: {problem}")
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

    @classmethod
    def _write(cls, path: Path, data: dict[str, Any]) -> None:
        tmp = cls._stage(path, data)
        try:
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    @staticmethod
    def _stage(path: Path, data: dict[str, Any]) -> str:
        """Write ``data`` to a fsynced temporary file beside ``path``; returns its name."""
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return tmp

    # -- for the CLI -------------------------------------------------------------------------------

    def files(self) -> list[Path]:
        """Every cache file (``<fingerprint id>/<op>.json`` regular files with safe names)."""
        root = self.root
        if not root.is_dir():
            return []
        return sorted(
            p
            for p in root.glob("*/*.json")
            if p.is_file() and NAME_PATTERN.fullmatch(p.parent.name) and NAME_PATTERN.fullmatch(p.stem)
        )

    def strays(self) -> list[Path]:
        """Things named like cache files that are not regular files (e.g. a directory ``<op>.json``)."""
        root = self.root
        return sorted(p for p in root.glob("*/*.json") if not p.is_file()) if root.is_dir() else []

    def entries(self) -> list[tuple[Path, str, dict[str, Any]]]:
        """Every well-formed ``(file, key, entry)`` on disk."""
        return [(p, k, e) for p in self.files() for k, e in sorted(self._read(p).items())]

    def clear(self) -> int:
        """Delete every cache file (and lock); returns how many entries went. :meth:`strays` are left alone."""
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
            entries, fingerprint = self._read_file(path)
            if entries:
                files.append(
                    {
                        "fingerprint_id": path.parent.name,
                        "op": path.stem,
                        "fingerprint": fingerprint,
                        "entries": entries,
                    }
                )
        return {"format": FORMAT, "kind": "ejkernel-config-cache", "files": files}

    @staticmethod
    def validate_export(document: object) -> list[tuple[str, str, dict[str, Any], dict[str, Any]]]:
        """The ``(fingerprint_id, op, fingerprint, entries)`` of each file of an export, all checked.

        Raises:
            ValueError: what is wrong and where (``files[2].entries['fwd|...']: 'impl' must be ...``).
        """
        if (
            not isinstance(document, dict)
            or document.get("kind") != "ejkernel-config-cache"
            or document.get("format") != FORMAT
        ):
            raise ValueError(f"not an ejkernel cache export of format {FORMAT} (expected keys 'kind' and 'format')")
        files = document.get("files")
        if not isinstance(files, list):
            raise ValueError(f"'files' must be a list, got {type(files).__name__}")
        out = []
        for i, f in enumerate(files):
            where = f"files[{i}]"
            if not isinstance(f, dict):
                raise ValueError(f"{where} must be an object, got {type(f).__name__}")
            for field in ("fingerprint_id", "op", "entries"):
                if field not in f:
                    raise ValueError(f"{where} has no {field!r}")
            check_name(f"{where}.fingerprint_id", f["fingerprint_id"])
            check_name(f"{where}.op", f["op"])
            fingerprint = f.get("fingerprint", {})
            if not isinstance(fingerprint, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in fingerprint.items()
            ):
                raise ValueError(f"{where}.fingerprint must be an object of strings, got {fingerprint!r}")
            entries = f["entries"]
            if not isinstance(entries, dict):
                raise ValueError(f"{where}.entries must be an object, got {type(entries).__name__}")
            for key, entry in entries.items():
                problem = entry_problem(entry)
                if problem is not None:
                    raise ValueError(f"{where}.entries[{key!r}]: {problem}")
            out.append((f["fingerprint_id"], f["op"], fingerprint, entries))
        return out

    def import_(self, document: object) -> int:
        """Merge an exported document into the cache, all or nothing; returns how many entries were written.

        The whole document is checked before anything is written; then every target file is merged
        and written to a temporary file under its lock, and only when all are ready are they moved
        into place.

        Raises:
            ValueError: the document is not a well-formed ejkernel cache export (nothing written).
            OSError: the cache directory cannot be written (nothing written).
        """
        merged: dict[Path, tuple[str, dict[str, Any], dict[str, Any]]] = {}
        n = 0
        for fp_id, op, fingerprint, entries in self.validate_export(document):
            path = self.path(fp_id, op)
            _, old_fp, old_entries = merged.get(path, (op, fingerprint, {}))
            merged[path] = (op, fingerprint or old_fp, {**old_entries, **entries})
            n += len(entries)
        paths = sorted(merged)
        with contextlib.ExitStack() as stack, self._lock:
            for path in paths:  # a fixed order: two importers cannot deadlock
                path.parent.mkdir(parents=True, exist_ok=True)
                stack.enter_context(filelock.FileLock(str(path) + ".lock", timeout=60))
            staged: list[tuple[str, Path]] = []
            try:
                for path in paths:
                    op, fingerprint, entries = merged[path]
                    on_disk, disk_fp = self._read_file(path)
                    data = {"format": FORMAT, "fingerprint": fingerprint or disk_fp, "op": op}
                    data["entries"] = {**on_disk, **entries}
                    staged.append((self._stage(path, data), path))
            except BaseException:
                for tmp, _ in staged:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                raise
            for tmp, path in staged:
                os.replace(tmp, path)
                self._loaded.pop(path, None)
        return n
