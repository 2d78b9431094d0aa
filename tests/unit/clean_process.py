"""Running a compile check in a fresh Python process, for tests that compile Gluon or Triton
kernels for sm_90 without a GPU.

Once an interpreted Triton kernel has run in a process (the suite runs under TRITON_INTERPRET=1),
Triton's interpreter has patched language builtins that Gluon's compiler shares, and compiling
there fails; a process of its own, without the interpreter, compiles as on the GPU machine."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def compile_in_clean_process(argv: list[str]) -> str:
    """Run ``python argv...`` without TRITON_INTERPRET; return its stdout (fail on its exit status)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
