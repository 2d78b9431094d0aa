"""The CUDA head kernel's libraries, built off the critical path by ``convt3d build`` or in a background thread at
auto's first sight of a call it could run (untimed until built); only ``backend="cuda"`` by name waits for nvcc."""
from __future__ import annotations

import sys
import threading
import time

import torch

from ...dispatch import first_call
from . import head

__all__ = ["DTYPES", "ready", "start", "status", "build", "main"]

DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_lock = threading.Lock()
_threads: dict[tuple, threading.Thread] = {}
_failed: dict[tuple, str] = {}


def _key(device: torch.device, dtype: torch.dtype) -> tuple:
    return head.library_path(device, dtype).name, dtype


def ready(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the library of ``dtype`` for this GPU is loaded or on disk: a call then costs no build."""
    return head.loaded(dtype) or head.library_path(device, dtype).exists()


def start(device: torch.device, dtype: torch.dtype) -> None:
    """Build the library in a background thread, once per process (a failure is kept for ``status``)."""
    key = _key(device, dtype)
    with _lock:
        if key in _threads or key in _failed:
            return

        def run():
            try:
                head.load_library(device, dtype)
            except Exception as exc:  # noqa: BLE001 -- the engine stays out of auto's candidates, with the reason
                _failed[key] = f"{type(exc).__name__}: {exc}"[:300]
            first_call.became_ready()  # decisions made without it are made again (built, or unsupported)

        thread = threading.Thread(target=run, name=f"convt3d-build-{dtype}", daemon=True)
        _threads[key] = thread
        thread.start()


def failure(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the library of ``dtype`` failed to build in this process, or None."""
    return _failed.get(_key(device, dtype))


def status(device: torch.device, dtype: torch.dtype) -> str:
    """"built", "building", "failed: ..." or "not built"."""
    key = _key(device, dtype)
    if key in _failed:
        return "failed: " + _failed[key]
    if ready(device, dtype):
        return "built"
    thread = _threads.get(key)
    return "building" if thread is not None and thread.is_alive() else "not built"


def build(device: torch.device | None = None) -> dict[str, float]:
    """Build every element type's library for this GPU now; seconds per element type."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    out = {}
    for dtype in DTYPES:
        t0 = time.perf_counter()
        head.load_library(device, dtype)
        out[str(dtype).replace("torch.", "")] = time.perf_counter() - t0
    return out


def main(argv: list[str] | None = None) -> int:
    """``convt3d build``: build the CUDA head kernel's libraries for this machine's GPU."""
    import argparse

    parser = argparse.ArgumentParser(prog="convt3d build", description="Build the CUDA head kernel's libraries for "
                                     "this machine's GPU (nvcc), so that no first call waits for them.")
    parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("convt3d build: no CUDA device here; nothing to build", file=sys.stderr)
        return 1
    if head.nvcc_path() is None:
        print("convt3d build: no CUDA compiler (nvcc) found: set CUDA_HOME or put nvcc on PATH", file=sys.stderr)
        return 1
    for name, seconds in build().items():
        print(f"{name}: {'built' if seconds > 0.5 else 'up to date'} ({seconds:.1f} s)")
    return 0
