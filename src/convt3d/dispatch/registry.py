"""The registry of the engines, filled by ``convt3d.engines`` in the dispatcher's order of
preference for ties: the dispatcher knows the engines only through it."""
from __future__ import annotations

HYBRID = "torch+bwd"  # PyTorch's forward recorded with convt3d's backward (training steps)

# name -> engine (``convt3d.engines.base.Engine``), in order of preference for ties.
ENGINES: dict = {}

def register(engine) -> None:
    """Add an engine under its name (a later one of the same name replaces it, keeping its place)."""
    ENGINES[engine.name] = engine

