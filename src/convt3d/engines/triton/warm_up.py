"""Triton's once-per-process setup, started off the first call's path."""
from __future__ import annotations

import threading

import torch

from .sites import interpreter_active

__all__ = ["start_warm_up"]

# The first kernel a process launches makes Triton compute its installation's key (the sha256 of
# libtriton and of its compiler and language sources, ``triton.runtime.cache.triton_key``, cached
# for the process) before it can find even a cached binary: most of a patched model's first
# call with every cache warm (tools/host_time.py first-call). It depends on nothing of the
# call, and hashing releases the GIL, so ``convt3d.patch`` starts it in a daemon thread: it
# overlaps whatever the caller does before the first call; a call that comes first computes the
# key itself, as without it. With convt3d imported the key imports nothing (triton 3.6 and
# 3.9): file reads and hashing only, so a process forked meanwhile (DataLoader workers)
# inherits no held import lock; Python 3.12's warning about forking a multi-threaded process can
# still fire while the thread runs. (A module of its own: the KernelBench files, which copy
# triton_sites, may hold no threads.)
_warm_up_started = False


def start_warm_up() -> None:
    """Start Triton's once-per-process key computation in a daemon thread (once; not under the
    interpreter, not without CUDA, and not where this Triton has no such key)."""
    global _warm_up_started
    if _warm_up_started or interpreter_active() or not torch.cuda.is_available():
        return
    _warm_up_started = True
    try:
        from triton.runtime.cache import triton_key  # triton 3.6 to 3.9
    except ImportError:
        return

    def work() -> None:
        try:
            triton_key()
        except Exception:  # noqa: BLE001 -- the first launch computes it again and reports any error
            pass

    threading.Thread(target=work, name="convt3d-triton-warm-up", daemon=True).start()
