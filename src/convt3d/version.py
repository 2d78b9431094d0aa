"""The package version and the digest of its sources (their own module, so that modules needing
them need not import the package)."""
from __future__ import annotations

import hashlib
from pathlib import Path

__version__ = "0.1.0"


def source_digest(root=None) -> str:
    """A digest of the ``.py`` and ``.cu`` sources under ``root`` (default: this package) by relative path and
    content: what ran, where neither git metadata nor the version tells (a copied tree, an editable install)."""
    root = Path(__file__).resolve().parent if root is None else Path(root)
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cu") and "__pycache__" not in p.parts):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]
