"""How a new layer signature's first call treats engines whose code is not compiled yet.

"background" (the default): auto decides among the engines that are ready, PyTorch's own call
always among them, while the others compile in background processes; once one becomes ready,
the signature's next call measures again with it. "wait": the first call compiles and times every
candidate before it returns, so its decision is final at once. ``CONVT3D_FIRST_CALL`` sets the
mode; ``convt3d.tune`` and multi-process runs wait (ranks must decide at the same call).
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

from . import distributed

__all__ = ["MODES", "ENV", "mode", "background", "waiting", "generation", "became_ready"]

ENV = "CONVT3D_FIRST_CALL"
MODES = ("background", "wait")
_local = threading.local()
_generation = [0]


def mode() -> str:
    """``CONVT3D_FIRST_CALL``, else "background"."""
    value = os.environ.get(ENV, "").strip() or "background"
    if value not in MODES:
        raise ValueError(f"environment variable {ENV}={value!r} is not a first-call mode; expected one of {MODES}")
    return value


def background() -> bool:
    """Whether engines still compiling are left out of this thread's decisions rather than waited for."""
    return mode() == "background" and not getattr(_local, "waits", 0) and not distributed.active()


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """Within the block, this thread's first calls compile and time every candidate (``convt3d.tune``)."""
    _local.waits = getattr(_local, "waits", 0) + 1
    try:
        yield
    finally:
        _local.waits -= 1


def generation() -> int:
    """A count that grows each time an engine becomes ready for some signature."""
    return _generation[0]


def became_ready() -> None:
    """Called by an engine (from any thread) when code it was compiling is ready: decisions made
    without it are measured again at their signature's next call."""
    _generation[0] += 1
