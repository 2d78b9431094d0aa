"""Triton's installation hash, which every compile and cached-kernel load needs: Triton computes it by reading
its whole compiler library in each process, so convt3d keeps it in its cache folder beside a stamp of the
installation (version, each file's size and modification time) and hands it to Triton (and the compile
workers) while the stamp holds. ``convt3d.patch`` starts this in a daemon thread, off the first call's path."""
from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from pathlib import Path

import torch
import triton

from ...dispatch.cache import cache_dir
from .compile_worker import use_installation_key

try:
    from triton.runtime import cache as triton_cache  # its triton_key: triton 3.6 to 3.9
except ImportError:  # pragma: no cover
    triton_cache = None

KEY_FILE = "triton_key.txt"  # in the cache folder's build/: the stamp's line, then the hash
_lock = threading.Lock()
_key: str | None = None
_warm_up_started = False


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # a fork during the hashing leaves the child a lock no thread will release


os.register_at_fork(after_in_child=_after_fork_in_child)


def _stamp() -> str:
    """Triton's version and the size and modification time of each file its hash reads."""
    root = Path(triton.__file__).parent
    h = hashlib.sha256(triton.__version__.encode())
    for sub in ("compiler", "backends", "language", "runtime", "_C"):
        for dirpath, dirnames, filenames in os.walk(root / sub):
            dirnames.sort()
            for name in sorted(filenames):
                if name.endswith((".py", ".so")):
                    path = os.path.join(dirpath, name)
                    st = os.stat(path)
                    h.update(f"{os.path.relpath(path, root)}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()


def installation_key(compute: bool = True) -> str | None:
    """Triton's installation hash, kept where its stamp holds, else (``compute``) computed and kept; this
    process's Triton uses it from then on. None under the interpreter, or where none is kept and not ``compute``."""
    global _key
    with _lock:
        original = getattr(triton_cache, "triton_key", None)
        if _key is not None or original is None or triton.knobs.runtime.interpret:
            return _key
        path = cache_dir() / "build" / KEY_FILE
        stamp = _stamp()
        try:
            saved_stamp, key = path.read_text(encoding="utf-8").split("\n", 1)
        except (OSError, ValueError):
            saved_stamp = key = None
        if saved_stamp != stamp or not key:
            if not compute:
                return None
            key = original()
            if not isinstance(key, str) or not key:
                return None  # not a hash this module knows how to keep
            with contextlib.suppress(OSError):  # a read-only cache folder: the next process computes it again
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f".{KEY_FILE}.{os.getpid()}.tmp")
                tmp.write_text(f"{stamp}\n{key}", encoding="utf-8")
                os.replace(tmp, path)
        use_installation_key(key)
        _key = key
        return key


def start_warm_up() -> None:
    """Hand Triton its kept installation hash now, else compute it once in a daemon thread (CUDA and compiled
    Triton only): the hashing releases the GIL, and the thread imports nothing (a fork inherits no held lock)."""
    global _warm_up_started
    if _warm_up_started or triton.knobs.runtime.interpret or not torch.cuda.is_available():
        return
    _warm_up_started = True
    if installation_key(compute=False) is not None:
        return

    def work() -> None:
        with contextlib.suppress(Exception):  # the first launch computes it again and reports any error
            installation_key()

    threading.Thread(target=work, name="convt3d-triton-warm-up", daemon=True).start()
