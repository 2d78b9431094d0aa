"""Triton's once-per-process setup, started off the first call's path."""
from __future__ import annotations

import threading

import torch

from .sites import interpreter_active

__all__ = ["start_warm_up"]

# A process's first launch hashes Triton's installation before finding even a cached binary: it
# depends on no call and releases the GIL, so ``convt3d.patch`` starts it in a daemon thread that
# imports nothing (a fork inherits no held import lock). Its own module: KernelBench files hold no threads.
_warm_up_started = False


def start_warm_up() -> None:
    """Start Triton's key computation in a daemon thread, once (CUDA and compiled Triton only)."""
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
