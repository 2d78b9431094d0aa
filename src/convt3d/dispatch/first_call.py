"""How a new signature's first call treats engines not compiled yet: "background" (the default) decides
among the ready ones, PyTorch's always among them, while the others compile in background processes, and
measures again once one is ready; "wait" compiles and times every candidate first, so the decision is final
at once. ``CONVT3D_FIRST_CALL`` sets it; ``convt3d.tune`` and multi-process runs wait (ranks decide together)."""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

from . import distributed

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
    """An engine's code became ready (any thread): decisions made without it measure again at their next call."""
    _generation[0] += 1
