"""``convt3d`` command line: ``convt3d <command> [options]``; each command lives in its own module
(``module`` or ``module:function``, imported when it runs) and parses its own options."""
from __future__ import annotations

import sys

COMMANDS = {
    "info": ("convt3d.info", "What this machine can run: GPU, versions, engines, caches (--json)"),
    "explain": ("convt3d.explain", "What convt3d would do with a call and why, from its shapes (nothing is run)"),
    "cache": ("convt3d.info:cache_main", "Show or clear convt3d's cache of measurements (and, on request, Triton's)"),
    "bench": ("convt3d.bench.cli", "Time convt3d against PyTorch/cuDNN on the bench suites"),
    "export-kernelbench": ("convt3d.kernelbench.command:export_main", "Regenerate the self-contained KernelBench ModelNew files"),
    "kernelbench": ("convt3d.kernelbench.command", "Evaluate the KernelBench ModelNew files as KernelBench does"),
    "tune": ("convt3d.bench.tune_suites", "Fill the auto-backend and Triton tuning cache by running the bench suites' layers "
                             "once (e.g. --suite layers)"),
}


def _usage() -> str:
    lines = ["usage: convt3d [-V | --version] <command> [options]", "", "commands:"]
    lines += [f"  {name:<20} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run 'convt3d <command> --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from .version import __version__

        print(f"convt3d {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"convt3d: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    import contextlib
    import importlib
    import os

    from .dispatch import first_call

    target, _, function = COMMANDS[name][0].partition(":")
    # Commands that time layers do so as tuned: first calls wait for every candidate, unless CONVT3D_FIRST_CALL is set.
    waits = name in ("bench", "kernelbench", "tune") and not os.environ.get(first_call.ENV)
    with first_call.waiting() if waits else contextlib.nullcontext():
        return int(getattr(importlib.import_module(target), function or "main")(rest) or 0)
