"""``convt3d`` command line: ``convt3d <command> [options]`` (also ``python -m convt3d``).

Each command lives in its own module and parses its own options; this file only routes.
"""
from __future__ import annotations

import sys

COMMANDS = {
    "build": ("convt3d.engines.cuda.build", "Build the CUDA head kernel's libraries for this GPU ahead of first calls"),
    "bench": ("convt3d.bench.cli", "Time convt3d against PyTorch/cuDNN on the bench suites"),
    "export-kernelbench": ("convt3d.kernelbench.export", "Regenerate the self-contained KernelBench ModelNew files"),
    "kernelbench": ("convt3d.kernelbench.evaluate", "Evaluate the KernelBench ModelNew files as KernelBench does"),
    "tune": ("convt3d.bench.tune_suites", "Fill the auto-backend and Triton tuning cache by running the bench suites' layers "
                             "once (e.g. --suite layers)"),
}


def _usage() -> str:
    lines = ["usage: convt3d <command> [options]", "", "commands:"]
    lines += [f"  {name:<20} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines.append("")
    lines.append("Run 'convt3d <command> --help' for a command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"convt3d: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    import importlib

    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)
