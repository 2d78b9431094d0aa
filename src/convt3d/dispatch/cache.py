"""The persistent cache of what convt3d measured: auto-backend decisions, Triton tile configs and
backward choices, one JSON file per GPU model and library versions; saves are atomic and merged
under a file lock, so concurrent processes lose nothing."""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import json
import os
import re
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any, Iterator

from ..core.memo import memo
from ..version import __version__, source_digest

try:  # POSIX only; without it saves are still atomic, merges may lose a concurrent entry
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

FORMAT = 1
SECTIONS = ("decisions", "triton_configs", "backward", "precision")
ENV_DIR = "CONVT3D_CACHE_DIR"
# The cache file is readable by all, as open() under the usual umask makes files (mkstemp: 0600).
FILE_MODE = 0o644


class CacheWarning(UserWarning):
    """The on-disk cache was ignored (corrupt, truncated, stale) or cannot be written."""


_warned: set[tuple[str, str]] = set()


def _warn_once(path: Path, kind: str, message: str) -> None:
    tag = (str(path), kind)
    if tag not in _warned:
        _warned.add(tag)
        warnings.warn(message, CacheWarning, stacklevel=3)


# ---- location and key ---------------------------------------------------------------------------
def cache_dir() -> Path:
    """``$CONVT3D_CACHE_DIR`` if set and non-empty, else ``~/.cache/convt3d``."""
    env = os.environ.get(ENV_DIR)
    if env:
        return Path(env).expanduser()
    try:
        home = Path.home()
    except (RuntimeError, KeyError):  # no home directory (some containers): a per-user temp dir
        home = Path(tempfile.gettempdir()) / f"convt3d-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    return home / ".cache" / "convt3d"


_source_digest = functools.cache(source_digest)  # read once per process


def environment_key(gpu: str) -> dict[str, str]:
    """What a cached measurement depends on besides the call: the GPU model, convt3d's version and
    source digest (an editable install keeps its version across edits), torch's and triton's."""
    import torch
    import triton

    return {"gpu": gpu, "convt3d": __version__, "source": _source_digest(), "torch": torch.__version__,
            "triton": triton.__version__}


def file_for(directory: Path, gpu: str) -> Path:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", gpu).strip("_.") or "device"
    return Path(directory) / f"{slug}.json"


# ---- one file -----------------------------------------------------------------------------------
def _empty() -> dict[str, dict]:
    return {s: {} for s in SECTIONS}


def _parse(text: str, key: dict) -> tuple[dict | None, str | None, str]:
    """(sections, None, "") of a valid file of this key, else (None, the problem, "corrupt" or "stale")."""
    if not text.strip():
        return None, "it is empty (truncated)", "corrupt"
    try:
        doc = json.loads(text)
    except ValueError as exc:  # JSONDecodeError is a ValueError
        return None, f"it is not valid JSON (corrupt or truncated: {exc})", "corrupt"
    if not isinstance(doc, dict) or not isinstance(doc.get("key"), dict):
        return None, "it does not have the structure of a convt3d cache file", "corrupt"
    if doc.get("format") != FORMAT or doc["key"] != key:
        found = {k: doc["key"].get(k) for k in key}
        return None, (f"it was written for {found} (format {doc.get('format')!r}), this process is {key} "
                      f"(format {FORMAT})"), "stale"
    sections = _empty()
    for s in SECTIONS:
        entries = doc.get(s, {})
        if not isinstance(entries, dict) or not all(isinstance(v, dict) for v in entries.values()):
            return None, f"its {s!r} section is malformed", "corrupt"
        sections[s] = entries
    return sections, None, ""


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """The directory's advisory lock (none without ``fcntl``), blocking: a waiter never gives up its entries."""
    if fcntl is None:
        yield
        return
    fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _stamp(path: Path) -> tuple | None:
    """What identifies one version of the file: (inode, size, mtime ns); None if absent."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class Store:
    """The cache file of one GPU model in one directory, loaded once, merged on every save."""

    def __init__(self, directory: Path | str, key: dict[str, str]):
        self.directory = Path(directory)
        self.key = dict(key)
        self.path = file_for(self.directory, self.key.get("gpu", "device"))
        self.entries = _empty()  # the file's valid entries plus this process's
        self._mine = _empty()  # this process's entries: they win when merging
        self._unsaved = False  # entries of this process that are not on disk yet
        self._stamp: tuple | None = None  # the version of the file last read
        self._lock = threading.RLock()
        self.writable = True
        self.loaded = False

    def _read(self) -> tuple[dict | None, str | None, str]:
        stamp = _stamp(self.path)
        try:
            text = self.path.read_text(encoding="utf-8")
        except (FileNotFoundError, NotADirectoryError):  # no file (yet) at this location
            self._stamp = None
            return _empty(), None, ""
        except (OSError, UnicodeDecodeError) as exc:
            return None, f"it cannot be read ({type(exc).__name__}: {exc})", "corrupt"
        # The stamp from before reading: a file replaced in between is read again at the next miss.
        self._stamp = stamp
        return _parse(text, self.key)

    def load(self) -> "Store":
        with self._lock:
            if self.loaded:
                return self
            self.loaded = True
            sections, problem, kind = self._read()
            if sections is None:
                _warn_once(self.path, kind, f"convt3d: ignoring the cache file {self.path}: {problem}; it is "
                                            "rewritten (measurements will be redone as needed)")
                self.save(force=True)
            else:
                self.entries = sections
            return self

    def refresh(self) -> bool:
        """Merge in what other processes saved since the last read (one ``stat`` if nothing); True if read."""
        with self._lock:
            self.load()
            if _stamp(self.path) == self._stamp:
                return False
            sections, _, _ = self._read()
            if sections is None:  # went bad meanwhile: the next save replaces it
                return True
            for s in SECTIONS:
                sections[s].update(self._mine[s])
                self.entries[s].update(sections[s])
            return True

    def get(self, section: str, name: str) -> dict | None:
        with self._lock:
            self.load()
            entry = self.entries[section].get(name)
            if entry is None and self.refresh():
                entry = self.entries[section].get(name)
            return entry

    def put(self, section: str, name: str, entry: dict, save: bool = True) -> None:
        with self._lock:
            self.load()
            self.entries[section][name] = entry
            self._mine[section][name] = entry
            self._unsaved = True
            if self not in _unsaved_stores:
                _unsaved_stores.append(self)
                _save_unsaved_at_exit()
            if save:
                self.save()

    def save(self, force: bool = False) -> bool:
        """Merge this process's entries into the file (atomic replace). False if not written."""
        with self._lock:
            if not self.writable or not (force or self._unsaved):
                return False
            tmp = None
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                with _locked(self.directory):
                    current, _, _ = self._read()  # a file that went bad meanwhile is simply replaced
                    merged = current if current is not None else _empty()
                    for s in SECTIONS:
                        merged[s].update(self._mine[s])
                    fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{self.path.name}.", suffix=".tmp")
                    with os.fdopen(fd, "w", encoding="utf-8") as f:
                        # One write of the whole text, not json.dump's chunks: the lock is held meanwhile.
                        f.write(json.dumps({"format": FORMAT, "key": self.key, **merged}, indent=1, sort_keys=True))
                        f.flush()
                        with contextlib.suppress(OSError, AttributeError):
                            os.fchmod(f.fileno(), FILE_MODE)
                        os.fsync(f.fileno())
                    os.replace(tmp, self.path)
                    tmp = None
                    self._stamp = _stamp(self.path)
                self.entries = merged
                self._unsaved = False
                return True
            except OSError as exc:
                self.writable = False
                _warn_once(self.directory, "unwritable", f"convt3d: the cache directory {self.directory} cannot be "
                           f"written ({type(exc).__name__}: {exc}); convt3d keeps its measurements in memory for this "
                           f"process only (set {ENV_DIR} to a writable directory to persist them)")
                return False
            finally:
                if tmp is not None:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)


_unsaved_stores: list[Store] = []  # stores whose entries may still be pending at exit
_save_unsaved_at_exit = functools.cache(lambda: atexit.register(save_unsaved))  # on first use, not at import
_reset_hooks: list = []  # what else a reset forgets (the Triton tuner's pending results)


def on_reset(hook) -> None:
    """Call ``hook()`` in :func:`reset`."""
    _reset_hooks.append(hook)


_stores: dict[tuple[str, str], Store] = memo("dispatch.cache.stores")


def store_for(gpu: str) -> Store:
    """The loaded store of ``gpu`` in the current cache directory (read once per process)."""
    directory = cache_dir()
    k = (str(directory), gpu)
    if k not in _stores:
        _stores[k] = Store(directory, environment_key(gpu)).load()
    return _stores[k]


def reset() -> None:
    """Forget loaded files, pending tuning results and the warnings given (tests)."""
    _stores.clear()
    _unsaved_stores.clear()
    _warned.clear()
    for hook in _reset_hooks:
        hook()


def load_decision(gpu: str, signature: str) -> dict | None:
    """A well-formed persisted decision for a call signature, or None."""
    entry = store_for(gpu).get("decisions", signature)
    if entry is None or not isinstance(entry.get("engine"), str):
        return None
    timings = entry.get("timings_ms", {})
    if not isinstance(timings, dict) or not all(isinstance(v, (int, float)) for v in timings.values()):
        return None
    return entry


def save_decision(gpu: str, signature: str, entry: dict) -> None:
    store_for(gpu).put("decisions", signature, entry)


def load_precision_class(gpu: str, signature: str) -> str | None:
    """How PyTorch's own call of this TF32-allowed float32 signature computes ("fp32" or "tf32")."""
    entry = store_for(gpu).get("precision", signature)
    return entry.get("class") if entry and entry.get("class") in ("fp32", "tf32") else None


def save_precision_class(gpu: str, signature: str, klass: str) -> None:
    store_for(gpu).put("precision", signature, {"class": klass})


def _jsonable(obj: Any) -> Any:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (tuple, list)):
        return [_jsonable(v) for v in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [type(obj).__name__] + [_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    return str(obj)  # torch.dtype, torch.device, ...


def tune_key_text(key) -> str:
    """The Triton engine's tune key as a stable string."""
    return json.dumps(_jsonable(key), separators=(",", ":"))


def config_to_dict(config) -> dict:
    return dataclasses.asdict(config)


def config_from_dict(data, candidates) -> object | None:
    """The candidate equal to ``data`` field by field, or None: only the engine's own candidates are trusted."""
    if not isinstance(data, dict):
        return None
    return next((cfg for cfg in candidates if dataclasses.asdict(cfg) == data), None)


def save_unsaved() -> None:
    """Save the stores whose entries are still pending (at exit)."""
    for store in list(_unsaved_stores):
        with contextlib.suppress(Exception):
            store.save()


# ---- what `convt3d cache` shows and clears ------------------------------------------------------
def owned_files() -> list[Path]:
    """convt3d's files in ``cache_dir()``: cache files, a save's leftover temporaries and Triton's kept
    installation hash; not the lock, which a save may hold."""
    d = cache_dir()
    patterns = ("*.json", ".*.json.*.tmp", "build/triton_key.txt")
    found = {f for pattern in patterns for f in d.glob(pattern)}
    return sorted(f for f in found if f.is_file() and (f.suffix != ".json" or _is_cache_file(f)))


def _is_cache_file(path: Path) -> bool:
    """A JSON file with the top-level ``format`` and ``key`` of a convt3d cache file (of any version)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and "format" in doc and isinstance(doc.get("key"), dict)


def file_summary(path: Path | str) -> tuple[dict[str, int], str | None]:
    """Entries per section of a cache file, and why this process would ignore it (corrupt, or stale: written
    for another ``environment_key``), None where it is current."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        doc = json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return {}, f"unreadable ({type(exc).__name__})"
    key = doc.get("key") if isinstance(doc, dict) else None
    if not isinstance(key, dict):
        return {}, "not a convt3d cache file"
    counts = {s: len(doc[s]) for s in SECTIONS if isinstance(doc.get(s), dict)}
    current = environment_key(str(key.get("gpu")))
    _, problem, kind = _parse(text, current)
    if kind == "stale":
        changed = [f"{k} {key.get(k)}" for k in current if key.get(k) != current[k]] or [f"format {doc.get('format')}"]
        problem = "stale: written for " + ", ".join(changed)
    return counts, problem
