"""One keyed registry for every memo and cache convt3d keeps in a process: each is a dict made
here under a name (or a cache with its own clear, registered here), so that ``clear_all`` forgets
them all and ``sizes`` shows what a process holds. Pure functions of the geometry memoised with
``functools.lru_cache`` hold no state and stay as they are."""
from __future__ import annotations

from typing import Callable

__all__ = ["memo", "on_clear", "clear_all", "sizes"]

_memos: dict[str, dict] = {}
_clears: dict[str, tuple[Callable[[], None], Callable[[], int]]] = {}


def memo(name: str) -> dict:
    """The process-wide dict named ``name`` (created on first use)."""
    return _memos.setdefault(name, {})


def on_clear(name: str, clear: Callable[[], None], size: Callable[[], int] = lambda: 0) -> None:
    """Register a cache that is not a plain dict (an lru_cache, a set) under ``name``."""
    _clears[name] = (clear, size)


def clear_all() -> None:
    """Forget every memo and cache of this process."""
    for d in _memos.values():
        d.clear()
    for clear, _ in _clears.values():
        clear()


def sizes() -> dict[str, int]:
    """Entries held per memo and cache, by name."""
    out = {name: len(d) for name, d in _memos.items()}
    out.update({name: size() for name, (_, size) in _clears.items()})
    return out
