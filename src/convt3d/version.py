"""The package version and the digest of its sources (their own module, so that modules needing
them need not import the package)."""
from __future__ import annotations

__version__ = "0.1.0"


def source_digest(root=None) -> str:
    """A digest of the package's own sources (every ``.py`` and ``.cu`` file under
    ``convt3d/``, by relative path and content): what ran, even where the checkout's git metadata
    is not the code's -- a copied working tree reports the commit it was copied onto -- and where
    the version string stays the same between commits (an editable install). Read afresh at each
    call (~60 files); the cache reads it once per process (``cache.environment_key``). ``root``:
    another copy of the package's directory (tests), by default this module's."""
    import hashlib
    from pathlib import Path

    root = Path(__file__).resolve().parent if root is None else Path(root)
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cu") and "__pycache__" not in p.parts):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]
