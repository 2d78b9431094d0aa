"""The KernelBench commands over both levels: ``convt3d kernelbench`` (level 1 in ``evaluate``, level 2 in
``evaluate_level2``) and ``convt3d export-kernelbench`` (``export``, ``export_level2``)."""
from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from . import evaluate, evaluate_level2, export, export_level2, level2
from .shake import ExportError


def main(argv: list[str] | None = None) -> int:
    args = evaluate.parse_args(argv)
    return evaluate_level2.main_level2(args, argv) if args.level == 2 else evaluate.main(argv, args)


def export_main(argv: list[str] | None = None) -> int:
    """``convt3d export-kernelbench``."""
    p = argparse.ArgumentParser(prog="convt3d export-kernelbench", description=export.__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="directory of the files (default: the checkout's kernelbench/)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file differs from a fresh export")
    p.add_argument("--level", choices=("1", "2", "all"), default="1",
                   help="level 1's files (default), level 2's (in the directory's level2/) or both")
    args = p.parse_args(argv)
    out = args.out if args.out is not None else export.default_out_dir()
    try:
        files = {p.file_name: export.render(p) for p in export.PROBLEMS} if args.level in ("1", "all") else {}
        if args.level in ("2", "all"):  # in level2/; the problems whose stages it cannot carry yet are named
            files.update((f"level2/{p.file_name}", export_level2.render(p)) for p in level2.PROBLEMS
                         if export_level2.exported(p))
            left = [str(p.id) for p in level2.PROBLEMS if not export_level2.exported(p)]
            if left:
                print(f"not exported yet (a stage computes with PyTorch): level 2 problems {', '.join(left)}",
                      file=sys.stderr)
    except ExportError as e:
        print(f"convt3d export-kernelbench: {e}", file=sys.stderr)
        return 1
    if args.check:
        stale = []
        for name, text in files.items():
            path = out / name
            current = path.read_text(encoding="utf-8") if path.is_file() else None
            if current != text:
                stale.append(name)
                diff = difflib.unified_diff((current or "").splitlines(), text.splitlines(), f"{path} (committed)",
                                            f"{name} (fresh export)", lineterm="", n=1)
                print("\n".join(list(diff)[:40]) if current is not None else f"{path}: missing", file=sys.stderr)
        if stale:
            print(f"convt3d export-kernelbench --check: {len(stale)} of {len(files)} files in {out} differ from a fresh "
                  "export; run 'convt3d export-kernelbench' and commit the result", file=sys.stderr)
            return 1
        print(f"{len(files)} KernelBench files in {out} are up to date")
        return 0
    for name, text in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text, encoding="utf-8")
    print(f"wrote {len(files)} KernelBench files to {out}")
    return 0
