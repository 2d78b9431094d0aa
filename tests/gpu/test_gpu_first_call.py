"""GPU tests of the "background" first-call mode: a new process with empty caches, a layer's
first call returns PyTorch's result while the Triton candidates compile in worker processes; the
calls that follow stay right, and once the candidates are ready one call measures them all and
the decision becomes final (recorded in the cache file, which a new process then reads)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
SRC = str(Path(__file__).resolve().parents[2] / "src")

CHILD = r'''
import json, sys, time, torch
import convt3d
from convt3d.dispatch import select
spec = json.loads(sys.argv[1])
dt = getattr(torch, spec["dtype"])
torch.manual_seed(0)
x = torch.randn(spec["n"], spec["cin"], *spec["size"], device="cuda", dtype=dt)
w = torch.randn(spec["cin"], spec["cout"], *spec["k"], device="cuda", dtype=dt) * 0.1
args = (None, spec["s"], spec["p"], 0, 1, 1)
ref = torch.nn.functional.conv_transpose3d(x.double(), w.double(), *args)
scale = ref.abs().max().item()
errs, provisional, first, deadline = [], [], None, time.monotonic() + 240
while time.monotonic() < deadline:
    y = convt3d.conv_transpose3d(x, w, *args)
    errs.append((y.double() - ref).abs().max().item() / scale)
    provisional.append(bool(select._provisional))
    if first is None:
        first = convt3d.explain(x, w, *args).engine
    if not provisional[-1]:
        break
    time.sleep(0.05)
e = convt3d.explain(x, w, *args)
print("RESULT", json.dumps(dict(first=first, final=e.engine, calls=len(errs),
      provisional=provisional[:1] + provisional[-1:], max_err=max(errs), reason=e.reason)))
'''

CASES = {
    "decoder-k2s2-bf16": dict(n=2, cin=96, cout=48, size=(24, 24, 24), k=(2, 2, 2), s=2, p=0, dtype="bfloat16"),
    "gan-k4s2p1-fp32": dict(n=2, cin=96, cout=48, size=(12, 12, 12), k=(4, 4, 4), s=2, p=1, dtype="float32"),
    # A layer whose TF32-allowed fp32 call cuDNN computes in full fp32 on H100 (the layers suite's
    # videogpt_k4s2p3): ours runs it at exact grade, and must settle all the same.
    "videogpt-k4s2p3-fp32": dict(n=4, cin=240, cout=240, size=(10, 34, 34), k=(4, 4, 4), s=2, p=3, dtype="float32"),
}


def _child(spec, env):
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], env=env, capture_output=True, text=True,
                       timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RESULT"))[7:]), r.stderr


@pytest.mark.parametrize("name", list(CASES), ids=list(CASES))
def test_first_call_runs_while_candidates_compile_then_settles(tmp_path, name):
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"), CONVT3D_CACHE_DIR=str(tmp_path / "c3d"),
               PYTHONPATH=SRC, CONVT3D_FIRST_CALL="background", CONVT3D_COMPILE_WORKERS="4")
    env.pop("TRITON_INTERPRET", None)
    tol = 2e-2 if CASES[name]["dtype"] == "bfloat16" else 1e-2
    cold, err = _child(CASES[name], env)
    assert cold["first"] == "torch" and cold["provisional"][0], cold
    assert "compile in background processes" in err
    assert not cold["provisional"][-1], f"never settled: {cold}"
    assert cold["max_err"] < tol, cold
    # A new process reads the final decision from the cache file: nothing to compile, nothing provisional.
    warm, _ = _child(CASES[name], env)
    assert warm["calls"] == 1 and not warm["provisional"][0] and warm["first"] == cold["final"], (cold, warm)
