"""The registry of the engines (filled by ``convt3d.engines`` in the dispatcher's order of
preference for ties) and of every memo and cache convt3d keeps in a process, so that one call
clears them all."""
from __future__ import annotations

from typing import Callable

__all__ = ["ENGINES", "HYBRID", "register", "memo", "on_clear", "clear_all"]

HYBRID = "torch+bwd"  # PyTorch's forward recorded with convt3d's backward (training steps)

# name -> engine (``convt3d.engines.base.Engine``), in order of preference for ties.
ENGINES: dict = {}

_memos: dict[str, dict] = {}
_clears: dict[str, Callable[[], None]] = {}


def register(engine) -> None:
    """Add an engine under its name (a later one of the same name replaces it, keeping its place)."""
    ENGINES[engine.name] = engine


def memo(name: str) -> dict:
    """The process-wide dict named ``name`` (created on first use); ``clear_all`` empties it."""
    return _memos.setdefault(name, {})


def on_clear(name: str, clear: Callable[[], None]) -> None:
    """Run ``clear`` in ``clear_all`` (caches that are not plain dicts: lru_cache, sets)."""
    _clears[name] = clear


def clear_all() -> None:
    """Forget every memo and cache of this process (tests, and a user who changed the GPU's state)."""
    for d in _memos.values():
        d.clear()
    for clear in _clears.values():
        clear()
    for engine in ENGINES.values():
        forget = getattr(engine, "forget", None)
        if forget is not None:
            forget()
