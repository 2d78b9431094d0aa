"""DDP with the gloo backend on the CPU, 2 processes (issue 5): a small 3-D decoder built from
convt3d.ConvTranspose3d (Triton engine through the interpreter) trains one step on each rank's half
of a batch; the averaged gradients must equal a single-process run on the whole batch.

Why the tolerance: both runs compute the same per-sample float32 arithmetic; DDP's all-reduce
averages two half-batch gradients where the single process sums the whole batch in one
reduction, so the two differ by fp32 summation order only (~1e-7 relative; 1e-5 is the bound).
"""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from conftest import requires_interpreter

pytestmark = requires_interpreter
WORLD = 2


def exit_worker() -> None:
    """End a worker that has done its work: a barrier, then ``os._exit(0)`` without tearing the
    process group down, whose teardown races (a gloo rank still closing its pairs when rank 0's
    store goes aborts in C++). Only for the success path: a failing worker raises."""
    import sys

    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _decoder() -> nn.Module:
    import convt3d

    torch.manual_seed(0)
    m = nn.Sequential(convt3d.ConvTranspose3d(8, 8, 2, stride=2), nn.ReLU(),
                      convt3d.ConvTranspose3d(8, 8, 2, stride=2, bias=False))
    for layer in (m[0], m[2]):
        layer.backend, layer.precision = "triton", "ieee"
    return m


def _data():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(WORLD, 8, 1, 1, 2, generator=gen)
    target = torch.randn(WORLD, 8, 4, 4, 8, generator=gen)
    return x, target


def _loss(model, x, target):
    return torch.nn.functional.mse_loss(model(x), target)


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        model = nn.parallel.DistributedDataParallel(_decoder())
        x, target = _data()
        _loss(model, x[rank:rank + 1], target[rank:rank + 1]).backward()
        if rank == 0:
            torch.save({n: p.grad for n, p in model.module.named_parameters()}, os.path.join(out_dir, "ddp.pt"))
    except BaseException:
        dist.destroy_process_group()
        raise
    # A barrier, then exit without tearing the group down: a gloo teardown can race rank 0's
    # store and abort in C++ (exit_worker's docstring).
    exit_worker()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_gloo_gradients_equal_single_process(tmp_path):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this build")
    # Children inherit TRITON_INTERPRET=1 from this process's environment (set by conftest).
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    ddp = torch.load(tmp_path / "ddp.pt")

    single = _decoder()
    x, target = _data()
    # The mean over the whole batch = the average of the per-rank means (equal halves).
    _loss(single, x, target).backward()
    assert set(ddp) == {n for n, _ in single.named_parameters()}
    for name, p in single.named_parameters():
        g = ddp[name]
        assert g is not None and g.shape == p.grad.shape
        scale = p.grad.abs().max().item()
        assert scale > 0
        err = (g - p.grad).abs().max().item()
        assert err <= 1e-5 * scale, f"{name}: DDP gradient differs by {err:.3g} (scale {scale:.3g})"
