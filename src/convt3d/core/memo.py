"""One keyed registry for every memo convt3d keeps in a process, so that ``clear_all`` forgets them all."""
from __future__ import annotations

_memos: dict[str, dict] = {}


def memo(name: str) -> dict:
    """The process-wide dict named ``name`` (created on first use)."""
    return _memos.setdefault(name, {})


def clear_all() -> None:
    """Forget every memo of this process."""
    for d in _memos.values():
        d.clear()
