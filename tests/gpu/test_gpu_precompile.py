"""GPU tests of the compile workers: after the candidates of a new signature are compiled by the
workers, timing them compiles nothing more in this process (every kernel comes from Triton's disk
cache), and the call is still right. A new process with empty caches for each case."""
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
import json, os, sys, torch, triton
from convt3d.core.validate import check_call
from convt3d.engines.triton import engine, precompile
from convt3d.engines.triton.peer import guarded
spec = json.loads(sys.argv[1])
dt = getattr(torch, spec["dtype"])
x = torch.randn(spec["n"], spec["cin"], *spec["size"], device="cuda", dtype=dt)
w = torch.randn(spec["cin"], spec["cout"], *spec["k"], device="cuda", dtype=dt)
if spec["cl"]:
    x = x.to(memory_format=torch.channels_last_3d)
args = (spec["s"], spec["p"], spec["op"], 1, 1)
params, _ = check_call(x, w, None, *args)
launch = engine.prepare(x, w, None, params, "tf32")
run = guarded(launch.run)
results = precompile.compile_candidates(launch.configs, run)
cache_dir = os.environ["TRITON_CACHE_DIR"]
built = lambda ext: sum(n.endswith(ext) for _, _, f in os.walk(cache_dir) for n in f)
before = built(".cubin"), built(".so")
outcomes = [run(cfg) for cfg in launch.configs]
after = built(".cubin"), built(".so")
ref = torch.nn.functional.conv_transpose3d(x.double(), w.double(), None, *args)
err = (launch.y.double() - ref).abs().max().item() / ref.abs().max().item()
print("RESULT", json.dumps(dict(jobs=len(results), errors=[v for v in results.values() if v],
      failed=[str(o) for o in outcomes if type(o).__name__ == "CandidateFailure"],
      new_cubins=after[0] - before[0], new_libraries=after[1] - before[1], configs=len(launch.configs), err=err)))
'''

CASES = {
    "decoder-k2s2-bf16-cl": dict(n=2, cin=64, cout=32, size=(16, 16, 16), k=(2, 2, 2), s=2, p=0, op=0,
                                 dtype="bfloat16", cl=True),
    "gan-k4s2p1-fp32": dict(n=2, cin=64, cout=32, size=(8, 8, 8), k=(4, 4, 4), s=2, p=1, op=0,
                            dtype="float32", cl=False),
    "head-k3s1-to-2-fp32": dict(n=1, cin=32, cout=2, size=(16, 16, 16), k=(3, 3, 3), s=1, p=1, op=0,
                                dtype="float32", cl=True),
}


@pytest.mark.parametrize("name", list(CASES), ids=list(CASES))
def test_timed_runs_find_every_kernel_compiled(tmp_path, name):
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"), CONVT3D_CACHE_DIR=str(tmp_path / "c3d"),
               PYTHONPATH=SRC, CONVT3D_COMPILE_WORKERS="4")
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(CASES[name])], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(next(l for l in r.stdout.splitlines() if l.startswith("RESULT"))[7:])
    assert out["jobs"] >= out["configs"] > 1
    assert out["errors"] == [] and out["failed"] == []
    assert out["new_cubins"] == 0, out  # no kernel compiled again in the parent
    assert out["new_libraries"] == 0, out  # nor a launcher (Triton versions that build one per kernel)
    assert out["err"] < (1e-2 if CASES[name]["dtype"] == "bfloat16" else 2e-3)
