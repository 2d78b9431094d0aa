"""The Gluon spike of issue 17 (``scripts/gluon_tap_gemm_spike.py``) compiles for sm_90a without a
GPU on the Triton installed here (CI's is newer than the GPU machine's 3.6): the Gluon API it
uses still exists under the names it binds. Its numerics are checked on the GPU by the script."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gluon_tap_gemm_spike.py"


def compile_in_clean_process(argv: list[str]) -> str:
    """Run ``python argv...`` without TRITON_INTERPRET; return its stdout (fail on its exit status)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPT.parents[1] / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _spike():
    spec = importlib.util.spec_from_file_location("gluon_tap_gemm_spike", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except ImportError as exc:  # a Triton without Gluon's Hopper modules
        pytest.skip(f"no Gluon Hopper API in this Triton: {exc}")
    return mod


@pytest.mark.parametrize("kernel", ["ring", "ws", "persistent", "box", "hbox"],
                         ids=["one-partition-ring", "producer-warp", "persistent", "position-boxes", "h-halo"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_spike_compiles_for_sm90(dtype, kernel):
    _spike()
    # PTX is the check (CI has no CUDA toolkit; ptxas's registers are the script's own report).
    # In a process of its own: once an interpreted Triton kernel has run in a process (the suite
    # runs under TRITON_INTERPRET=1), Triton's interpreter has patched language builtins that
    # Gluon's compiler shares, and compiling there fails.
    out = compile_in_clean_process([str(SCRIPT), "--compile-only", "--dtype", dtype, "--kernel", kernel,
                                    "--stages", "3", "--ptxas", "none"])
    assert f"tap_gemm {kernel} {dtype}: tiles 128x64x32, 3 stages" in out and "B shared memory" in out


@pytest.mark.parametrize("problem", [
    dict(n=2, cin=4, cout=3, size=(3, 4, 5), k=3, dil=2, pad=2),
    dict(n=1, cin=2, cout=5, size=(2, 3, 4), k=3, dil=1, pad=1),
    dict(n=2, cin=3, cout=1, size=(3, 3, 2), k=2, dil=1, pad=1),
], ids=["kb77-like-k3-d2", "k3-d1", "k2-cout1"])
def test_spike_rows_and_shifts_are_the_padded_correlation(problem):
    # The host side of the GPU check, on the CPU: the kernels' arithmetic over the padded
    # channels-last rows (tap shifts, zero rows past the end) restricted to the valid rows is
    # the dilated correlation that the script compares the kernels with.
    import torch

    mod = _spike()
    x, wt, rows, wk = mod.make_problem(problem, torch.float64, "cpu")
    got = mod.valid_outputs(mod.tap_gemm_torch(rows, wk, problem), problem)
    ref = mod.reference(x, wt, problem)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
