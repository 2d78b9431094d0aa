"""Data-parallel training with convt3d layers, one process per device, started by ``torchrun``
(``tests/gpu/multi_gpu_train.py`` trains and reports; this file judges):

* on 2+ GPUs (NCCL; skipped below 2 CUDA devices): DDP and FSDP2 (``fully_shard``), fp32 at exact
  grade and bf16 autocast. The gradients after one step equal those of a single-process run of
  the same model on the concatenated batch, within the dtype's tolerance; the loss over 50 SGD
  steps tracks the untouched model's and falls; every rank ran with the same engine per call
  signature, the same Triton tile per tune key and the same backward implementation per
  signature (auto in benchmark mode: rank 0 measures, ``convt3d.dispatch.distributed``).
* on the CPU (gloo, 2 processes, convt3d's Triton kernels through the interpreter, fp32 only --
  the interpreter mis-computes bf16): the same gradient check for DDP and FSDP2 on a tiny
  decoder, and 3 steps of loss tracking the untouched model's (falling, not halved).

Tolerances, per parameter, on max |g - g_ref| relative to max |g_ref|:
* fp32 exact grade: 1e-4. Both runs compute the same per-sample fp32 arithmetic; the wrapped run
  sums two half-batch gradients where the reference sums the batch at once, and the engines
  chosen for batch B and 2B may differ (tf32x3 vs cuDNN exact): fp32 summation order, ~1e-6.
* bf16 autocast: 3e-2. The weight gradient of each half batch is rounded to bf16 (2^-9
  relative) before the average, against one rounding of the whole batch's, and activations are
  bf16 through four layers (a few units of 2^-8). A gradient missing one rank's half, or counted
  twice, is off by ~50%.
Loss curves: |loss_patched - loss_untouched| <= 1e-3 (fp32) / 5e-2 (bf16) of the initial loss at
every step, and both fall below half the initial loss (GPU, 50 steps).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import requires_interpreter

HELPER = Path(__file__).with_name("multi_gpu_train.py")
GRAD_TOL = {"fp32": 1e-4, "bf16": 3e-2}
LOSS_TOL = {"fp32": 1e-3, "bf16": 5e-2}
RUNS = [f"{w}-{d}" for w in ("ddp", "fsdp2") for d in ("fp32", "bf16")]
CPU_RUNS = ["ddp-fp32", "fsdp2-fp32"]
GPU_COUNT = torch.cuda.device_count() if torch.cuda.is_available() else 0


def launch(out: Path, nproc: int, *args: str, timeout: float) -> list[dict]:
    """torchrun the helper; every rank's report (a failed rank's traceback is shown)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(HELPER), "--out", str(out), *args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parents[2] / "src"),
                                                                     os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    errors = [r["traceback"] for r in reports if "error" in r]
    assert proc.returncode == 0 and not errors and len(reports) == nproc, (
        f"torchrun exit {proc.returncode}, {len(reports)} reports\n" + "\n".join(errors)
        + proc.stdout[-3000:] + proc.stderr[-3000:])
    return sorted(reports, key=lambda r: r["rank"])


def check_gradients(reports: list[dict], run: str) -> None:
    tol = GRAD_TOL[run.split("-")[1]]
    for rep in reports:
        worst = {name: g["err"] / g["scale"] for name, g in rep["runs"][run]["grads"].items()}
        assert all(g["scale"] > 0 for g in rep["runs"][run]["grads"].values())
        bad = {k: f"{v:.3g}" for k, v in worst.items() if not v <= tol}
        assert not bad, f"{run} rank {rep['rank']}: gradients off the single-process run by more than {tol}: {bad}"


def check_loss_curves(reports: list[dict], run: str, steps: int, fall: float) -> None:
    tol = LOSS_TOL[run.split("-")[1]]
    r = reports[0]["runs"][run]
    patched, untouched = r["loss_patched"], r["loss_untouched"]
    assert len(patched) == len(untouched) == steps
    for rep in reports[1:]:  # the losses are all-reduced: every rank reports the same curve
        assert rep["runs"][run]["loss_untouched"] == untouched
    dev = max(abs(a - b) for a, b in zip(patched, untouched)) / untouched[0]
    assert dev <= tol, f"{run}: patched loss strays {dev:.3g} of the initial loss from the untouched one"
    assert patched[-1] < fall * patched[0] and untouched[-1] < fall * untouched[0], (patched, untouched)


# ---- 2+ GPUs ------------------------------------------------------------------------------------
gpus = pytest.mark.skipif(GPU_COUNT < 2, reason=f"needs 2 CUDA devices ({GPU_COUNT} here)")
GPU_STEPS = 50


@pytest.fixture(scope="module")
def gpu_reports(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("multi_gpu"), GPU_COUNT, "--device", "cuda", "--steps", str(GPU_STEPS),
                  timeout=1200)


@gpus
@pytest.mark.gpu
@pytest.mark.parametrize("run", RUNS)
def test_gpu_gradients_equal_single_process(run, gpu_reports):
    check_gradients(gpu_reports, run)


@gpus
@pytest.mark.gpu
@pytest.mark.parametrize("run", RUNS)
def test_gpu_loss_tracks_untouched_model(run, gpu_reports):
    check_loss_curves(gpu_reports, run, GPU_STEPS, fall=0.5)


@gpus
@pytest.mark.gpu
@pytest.mark.parametrize("what", ["auto", "tuning", "backward"])
def test_gpu_every_rank_ran_with_rank0s_decisions(what, gpu_reports):
    first = gpu_reports[0]["decisions"][what]
    assert first, f"no {what} decisions recorded: the check would be empty"
    for rep in gpu_reports[1:]:
        mine = rep["decisions"][what]
        assert set(mine) == set(first), f"rank {rep['rank']} saw other {what} signatures than rank 0"
        differ = {k: (first[k], mine[k]) for k in first if mine[k] != first[k]}
        assert not differ, f"rank {rep['rank']} decided {what} differently from rank 0: {differ}"


# ---- CPU, gloo ----------------------------------------------------------------------------------
# Each interpreted layer call costs 0.3-1.3 s (2026-12-01, triton 3.9 on this 2-core machine):
@pytest.mark.gpu
@pytest.mark.skipif(GPU_COUNT < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("backend", ["triton", "auto", "conv3d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_layer_on_another_device_than_the_current_one(backend, dtype):
    """A model moved to cuda:1 and called while cuda:0 is current (no torch.cuda.set_device):
    Triton launches on the current device, so convt3d makes the tensors' device current. Three
    calls (the first call's measurement and tuning, then the steady path) and a training step,
    against PyTorch on the same device."""
    import torch.nn.functional as F

    import convt3d

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 1)
    torch.manual_seed(0)
    s = 1 if backend == "conv3d" else 2
    m = convt3d.ConvTranspose3d(32, 16, 3, stride=s, padding=1).to(dev, dtype)
    m.backend = backend
    x = torch.randn(2, 32, 9, 10, 11, device=dev, dtype=dtype, requires_grad=True)
    ref = F.conv_transpose3d(x.double(), m.weight.double(), m.bias.double(), s, 1)
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    for _ in range(3):
        with torch.no_grad():
            y = m(x)
        assert y.device == dev and (y.double() - ref).abs().max().item() <= tol * ref.abs().max().item()
    y = m(x)
    y.float().square().sum().backward()
    assert x.grad is not None and x.grad.device == dev and torch.isfinite(x.grad).all()
    assert torch.cuda.current_device() == 0


# 3 steps per wrapper keep the run near a minute.
CPU_STEPS = 3


@pytest.fixture(scope="module")
def cpu_reports(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("multi_cpu"), 2, "--device", "cpu", "--dtype", "fp32", "--engine", "triton",
                  "--steps", str(CPU_STEPS), timeout=600)


@requires_interpreter
@pytest.mark.parametrize("run", CPU_RUNS)
def test_cpu_gloo_gradients_equal_single_process(run, cpu_reports):
    check_gradients(cpu_reports, run)


@requires_interpreter
@pytest.mark.parametrize("run", CPU_RUNS)
def test_cpu_gloo_loss_tracks_untouched_model(run, cpu_reports):
    check_loss_curves(cpu_reports, run, CPU_STEPS, fall=1.0)
