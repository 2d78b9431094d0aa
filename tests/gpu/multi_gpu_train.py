"""Data-parallel training of a small 3-D decoder patched with convt3d, one process per device,
started by torchrun (``tests/gpu/test_multi_gpu.py`` launches it and judges what it reports)::

    torchrun --standalone --nproc-per-node 2 tests/gpu/multi_gpu_train.py --out DIR
    torchrun --standalone --nproc-per-node 2 tests/gpu/multi_gpu_train.py --out DIR --device cpu --steps 5

For each wrapper (DDP; FSDP2, ``torch.distributed.fsdp.fully_shard`` on every ConvTranspose3d and
the root) and each precision (fp32 with TF32 off; bf16 under ``torch.autocast``) every rank
measures and writes to ``DIR/rank<r>.json``:

* ``grads``: after one step on its slice of a global batch, the wrapped model's gradient of every
  parameter against a single-process run of the same patched model on the whole (concatenated)
  batch -- max abs difference and the reference's max abs value, per parameter. DDP and FSDP2
  average the per-rank mean losses' gradients; with equal slices that is the gradient of the
  whole batch's mean.
* ``loss_patched`` / ``loss_untouched``: the loss (mean over ranks) of ``steps`` SGD steps of the
  patched model and of the untouched ``nn.ConvTranspose3d`` model, same initial weights and data.
* ``decisions``: what this rank ran with -- the engine auto chose per call signature, the Triton
  tile per tune key, the backward's dX/dW implementation per signature -- so the parent can check
  that every rank took the same (``convt3d.dispatch.distributed``).

Nothing is asserted here: the test compares the numbers with its tolerances and shows them.
Devices: ``cuda`` (NCCL, one GPU per rank, auto with benchmark mode on: rank 0 measures) or
``cpu`` (gloo; ``--engine triton`` runs convt3d's Triton kernels through the interpreter, which
must be on: TRITON_INTERPRET=1).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from convt3d.engines.triton.configs import tuning_log

WRAPS = ("ddp", "fsdp2")
DTYPES = ("fp32", "bf16")
LOCAL_BATCH = 2
# The decoder per device: on the GPU large enough that auto measures and the tuner times several
# tiles (what must agree across ranks), with the layer kinds of generators and U-Net decoders (k4
# s2 p1, anisotropic (1, 2, 2), stride-1 k3); on the CPU only the kinds Triton's interpreter runs
# in milliseconds at these sizes (k2 s2, (1, 2, 2)): a k3 or k4 layer takes it 1-7 s per call.
# (in channels, out channels, kernel, stride, padding) per ConvTranspose3d; input spatial size.
SIZES = {"cuda": dict(layers=((64, 64, 4, 2, 1), (64, 32, (1, 2, 2), (1, 2, 2), 0), (32, 16, 3, 1, 1),
                              (16, 1, 3, 1, 1)), spatial=(4, 8, 8)),
         "cpu": dict(layers=((8, 8, 2, 2, 0), (8, 4, (1, 2, 2), (1, 2, 2), 0), (4, 1, 2, 2, 0)), spatial=(1, 1, 2))}


def decoder(layers) -> nn.Module:
    """A 3-D decoder: up-convolutions with ReLU between them, group norm after the first (per
    sample, so splitting the batch changes nothing, unlike BatchNorm), no bias on the head."""
    mods: list[nn.Module] = []
    for i, (cin, cout, k, s, p) in enumerate(layers):
        last = i == len(layers) - 1
        mods.append(nn.ConvTranspose3d(cin, cout, k, stride=s, padding=p, bias=not last))
        if i == 0:
            mods.append(nn.GroupNorm(4 if cout % 4 == 0 else 1, cout))
        if not last:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


def global_batch(world: int, layers, spatial: tuple[int, int, int], device) -> tuple[torch.Tensor, ...]:
    """The same (input, target) on every rank; rank r trains on rows [r*B, (r+1)*B). The target
    is a fixed teacher decoder's output, so the loss can fall."""
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(world * LOCAL_BATCH, layers[0][0], *spatial, generator=gen)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(99)
        teacher = decoder(layers)
    with torch.no_grad():
        target = teacher(x)
    return x.to(device), target.to(device)


def _loss(model, x, target, dtype: str):
    with torch.autocast(x.device.type, torch.bfloat16, enabled=dtype == "bf16"):
        y = model(x)
    return F.mse_loss(y.float(), target)


def _wrap(model: nn.Module, wrap: str, device) -> nn.Module:
    if wrap == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for m in model.modules():
        if isinstance(m, nn.ConvTranspose3d):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _inner(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _patched(base: nn.Module, engine: str | None) -> nn.Module:
    import convt3d

    return convt3d.patch(copy.deepcopy(base), backend=engine, precision="ieee" if engine == "triton" else None)


def gradient_check(base, wrap, dtype, x, target, device, engine) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = _patched(base, engine)  # one process, the whole batch
    _loss(reference, x, target, dtype).backward()
    wrapped = _wrap(_patched(base, engine), wrap, device)
    sl = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    _loss(wrapped, x[sl], target[sl], dtype).backward()
    out = {}
    ref_params = dict(reference.named_parameters())
    for name, p in _inner(wrapped).named_parameters():
        g, r = _full(p.grad).float(), ref_params[name].grad.float()
        out[name] = {"err": (g - r).abs().max().item(), "scale": r.abs().max().item()}
    return out


def loss_curves(base, wrap, dtype, x, target, device, engine, steps: int, lr: float) -> dict:
    rank = dist.get_rank()
    sl = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    curves = {}
    for label, model in (("patched", _patched(base, engine)), ("untouched", copy.deepcopy(base))):
        model = _wrap(model, wrap, device)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        losses = []
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = _loss(model, x[sl], target[sl], dtype)
            loss.backward()
            opt.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / dist.get_world_size())
        curves[f"loss_{label}"] = losses
    return curves


def decisions_seen(events: list) -> dict:
    """What this rank ran with, keyed without the device index (comparable across ranks)."""
    from convt3d.engines.triton import backward
    from convt3d.dispatch import cache
    from convt3d.engines.triton import engine as triton_engine

    tuning = {cache.tune_key_text(k): rec.config.short() for k, rec in tuning_log().items()}
    bwd = {}
    for kind, table in (("dW", backward.choices()), ("dX", backward.dgrad_choices())):
        for key, c in table.items():
            bwd[f"{kind} {key[1:]!r}"] = f"{c.impl} {c.config.short() if c.config is not None else ''}".strip()
    auto = {sig: f"{d.engine} {d.precision}{' +ours_bwd' if getattr(d, 'ours_backward', False) else ''}"
            for sig, d in events}
    return {"auto": auto, "tuning": tuning, "backward": bwd}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--wrap", default=",".join(WRAPS))
    p.add_argument("--dtype", default=",".join(DTYPES))
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--engine", default=None, help="convt3d backend of the patched layers (default: auto)")
    args = p.parse_args(argv)

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    import convt3d
    from convt3d.dispatch import select as dispatch

    if args.device == "cuda":
        convt3d.set_benchmark(True)  # auto measures: the decisions that must agree across ranks
    events: list = []
    size = SIZES[args.device]
    result = {"rank": rank, "world": dist.get_world_size(), "device": str(device), "runs": {}}
    try:
        with dispatch.listening(lambda ev, info: events.append((info["signature"], info["decision"]))
                                if ev == "decision" else None):
            for dtype in args.dtype.split(","):
                # fp32 runs at exact grade on both sides (TF32 off): the gradient check's
                # tolerance is then fp32 summation order, not TF32 rounding.
                torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = dtype != "fp32"
                x, target = global_batch(dist.get_world_size(), size["layers"], size["spatial"], device)
                for wrap in args.wrap.split(","):
                    torch.manual_seed(0)
                    base = decoder(size["layers"]).to(device)
                    run = {"grads": gradient_check(base, wrap, dtype, x, target, device, args.engine)}
                    run.update(loss_curves(base, wrap, dtype, x, target, device, args.engine, args.steps, args.lr))
                    result["runs"][f"{wrap}-{dtype}"] = run
        result["decisions"] = decisions_seen(events)
    except Exception as exc:  # reported, then re-raised: the launcher sees a failed rank
        import traceback

        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
        _write_report(args.out, rank, result)
        dist.destroy_process_group()
        raise
    _write_report(args.out, rank, result)
    # A barrier, then exit without tearing the group down: a gloo rank still closing its pairs
    # when rank 0's store goes aborts in C++, and with no destructors run nothing is left to race.
    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _write_report(out: Path, rank: int, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
