"""``convt3d bench --suite networks --ddp N``: a DistributedDataParallel training step of each
network on N GPUs (one spawned process each, NCCL), patched vs untouched. Rounds of back-to-back
steps alternate between the models in pairs, a round's time the slowest rank's (DDP steps in
lockstep), the speedup the median of the pairs' ratios. ``device="cpu"`` runs the same with gloo,
for the tests."""
from __future__ import annotations

import copy
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from .check import failure_entry
from .runner import event_seconds
from .stats import paired_ratio

__all__ = ["DDPUnavailableError", "unavailable_reason", "run_ddp", "format_rows", "exit_worker"]

# A round lasts about ROUND_S (within MIN_ITERS..MAX_ITERS steps); 11 pairs of rounds put the median
# between quartiles of 3 pairs or more, in seconds a network.
ROUND_S = 0.2
MIN_ITERS, MAX_ITERS = 3, 100
WARMUP_STEPS = 3
ROUNDS = 11
# A rank stuck in a collective (another rank died or ran out of memory) errors out after this long.
PG_TIMEOUT_S = 900


class DDPUnavailableError(RuntimeError):
    """``--ddp N`` cannot run here (fewer than N GPUs, no NCCL); the message is one line."""


def unavailable_reason(nproc: int, device: str = "cuda") -> str | None:
    """None if N processes of ``device`` can run here, else one line saying why not."""
    import torch.distributed as dist

    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        return f"--ddp needs a positive number of processes, got {nproc!r}"
    if not dist.is_available():
        return "--ddp needs torch.distributed, which this torch build lacks"
    if device == "cpu":
        return None if dist.is_gloo_available() else "--ddp on the CPU needs the gloo backend"
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < nproc:
        return (f"--ddp {nproc} needs {nproc} CUDA GPUs (one per process); this machine has "
                f"{count if count else 'none'}")
    if not dist.is_nccl_available():
        return f"--ddp {nproc} needs the NCCL backend, which this torch build lacks"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- in each rank ---------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _per_step(step: Callable[[], None], iters: int, device: torch.device) -> float:
    """Seconds per step of ``iters`` back-to-back steps (CUDA events; wall clock on the CPU)."""
    _sync(device)
    if device.type == "cuda":
        return event_seconds(step, iters)
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    return (time.perf_counter() - t0) / iters


def _collective(value, dtype: torch.dtype, device: torch.device, op: str):
    """``value`` after a collective over the ranks: "max" (all_reduce), "sum" (all_reduce) or "rank0" (broadcast)."""
    import torch.distributed as dist

    t = torch.tensor([value], dtype=dtype, device=device)
    if op == "rank0":
        dist.broadcast(t, 0)
    else:
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return t.item()


def _ddp_step(model, x: torch.Tensor, target: torch.Tensor, autocast: bool) -> Callable[[], None]:
    from .networks import first_tensor

    def step() -> None:
        model.zero_grad(set_to_none=True)
        with torch.autocast(x.device.type, torch.bfloat16, enabled=autocast):
            out = first_tensor(model(x))
        F.mse_loss(out.float(), target).backward()

    return step


def _time_network(net, mode, backend: str, device: torch.device, tiny: bool, seed: int,
                  round_s: float, rounds: int) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import convt3d

    from . import networks

    rank, world = dist.get_rank(), dist.get_world_size()
    # Every rank its own batch (the seed shifted by the rank); the initial weights differ too,
    # but DDP starts every rank from rank 0's.
    model, x = networks.build_network(net, device, tiny=tiny, seed=seed + 7919 * rank)
    patched = convt3d.patch(copy.deepcopy(model), backend=None if backend == "auto" else backend)
    model.train()
    patched.train()
    with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=mode.autocast):
        shape = networks.first_tensor(model(x)).shape
    target = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 31 * rank)).to(device)
    ids = [device.index] if device.type == "cuda" else None
    steps = {"torch": _ddp_step(DDP(model, device_ids=ids), x, target, mode.autocast),
             "convt3d": _ddp_step(DDP(patched, device_ids=ids), x, target, mode.autocast)}
    row = {"case": net.name, "suite": "networks", "source": net.source, "description": net.description,
           "mode": mode.name, "dtype": mode.dtype, "autocast": mode.autocast, "layout": "ncdhw",
           "precision": "default", "backend": backend, "ddp": world, "device": torch.cuda.get_device_name(device)
           if device.type == "cuda" else "cpu", "input_shape_per_rank": list(x.shape),
           "parameters": sum(p.numel() for p in model.parameters()),
           "convt_layers": networks.convt_layer_count(model)[0]}

    for name, step in steps.items():  # first steps: compile, tune, measure (rank 0), build buckets
        _sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        step()
        _sync(device)
        row[f"{'torch_' if name == 'torch' else ''}first_step_s"] = _collective(time.perf_counter() - t0,
                                                                               torch.float64, device, "max")
    estimate = {}
    for name, step in steps.items():
        estimate[name] = _per_step(step, WARMUP_STEPS, device)
    iters = int(_collective(max(MIN_ITERS, min(MAX_ITERS, int(round_s / max(max(estimate.values()), 1e-6)))),
                            torch.int64, device, "rank0"))
    times: dict[str, list[float]] = {"torch": [], "convt3d": []}
    for r in range(rounds):
        for name in (("torch", "convt3d") if r % 2 == 0 else ("convt3d", "torch")):
            dist.barrier()
            times[name].append(_collective(_per_step(steps[name], iters, device), torch.float64, device, "max"))
    ratio, low, high = paired_ratio(times["torch"], times["convt3d"])
    t_u, t_p = statistics.median(times["torch"]), statistics.median(times["convt3d"])
    row.update(iters_per_round=iters, torch_us=t_u * 1e6, convt3d_us=t_p * 1e6, speedup=ratio,
               speedup_quartiles=[low, high],
               torch_us_rounds=[t * 1e6 for t in times["torch"]],
               convt3d_us_rounds=[t * 1e6 for t in times["convt3d"]])
    return row


def exit_worker() -> None:
    """End a multi-process worker that has done its work: a barrier, then ``os._exit(0)`` without
    tearing the process group down, whose teardown races (a gloo rank still closing its pairs when
    rank 0's store goes aborts in C++). Only for the success path: a failing worker raises."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _worker(rank: int, world: int, port: int, spec: dict, out_dir: str) -> None:
    import torch.distributed as dist

    from . import networks

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    if spec["device"] == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device,
                                timeout=timedelta(seconds=PG_TIMEOUT_S))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=PG_TIMEOUT_S))
    rows, failures, skipped = [], [], []
    modes = {m.label: m for m in networks.NET_MODES + (networks.NetMode("train", "fp32"),)}
    try:
        for name in spec["nets"]:
            net = networks.select_networks([name])[0]
            reason = networks.unavailable_reason(net)
            if reason is not None:
                skipped.append({"case": net.name, "reason": reason})
                continue
            for label in spec["modes"]:
                mode = modes[label]
                row, error = None, None
                try:
                    row = _time_network(net, mode, spec["backend"], device, spec["tiny"], spec["seed"],
                                        spec["round_s"], spec["rounds"])
                except Exception as exc:  # noqa: BLE001 -- one network's failure must not hide the others
                    error = failure_entry(exc, case=net.name, mode=mode.name, dtype=mode.dtype, rank=rank)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                # A failure on every rank (out of memory, a build error) is a row; on some ranks
                # only, the others are stuck in a collective until PG_TIMEOUT_S.
                if _collective(0 if error is None else 1, torch.int64, device, "sum") == 0:
                    rows.append(row)
                elif error is not None:
                    failures.append(error)
    except BaseException:
        dist.destroy_process_group()
        raise
    finally:  # what rank 0 measured, also when a later network raised
        if rank == 0:
            Path(out_dir, "ddp.json").write_text(json.dumps({"rows": rows, "failures": failures, "skipped": skipped}))
    exit_worker()


# ---- the launcher ---------------------------------------------------------------------------------
def run_ddp(nproc: int, nets=None, modes=None, backend: str = "auto", *, device: str = "cuda", tiny: bool = False,
            seed: int = 0, round_s: float = ROUND_S, rounds: int = ROUNDS,
            status: Callable[[str], None] | None = None) -> tuple[list[dict], list[dict], list[dict]]:
    """Time a DDP training step of each network (default: all) in each training mode (default:
    bf16) on ``nproc`` processes: (rows, failures, skipped), rows as the networks suite's plus
    ``ddp`` and the first steps' times. Raises DDPUnavailableError (one line) where ``nproc``
    processes cannot run, ValueError for an inference mode."""
    import torch.multiprocessing as mp

    from . import networks

    why = unavailable_reason(nproc, device)
    if why is not None:
        raise DDPUnavailableError(why)
    nets = networks.select_networks() if nets is None else list(nets)
    modes = networks.select_modes("full") if modes is None else list(modes)
    bad = [m.label for m in modes if not m.training]
    if bad:
        raise ValueError(f"--ddp times training steps; {', '.join(bad)} is not a training mode")
    spec = {"nets": [n.name for n in nets], "modes": [m.label for m in modes], "backend": backend, "device": device,
            "tiny": tiny, "seed": seed, "round_s": round_s, "rounds": rounds}
    say = status or (lambda _msg: None)
    say(f"DDP on {nproc} {'GPUs' if device == 'cuda' else 'CPU processes'}: {len(nets)} networks, "
        f"{', '.join(spec['modes'])}")
    with tempfile.TemporaryDirectory(prefix="convt3d-ddp-") as out:
        mp.start_processes(_worker, args=(nproc, _free_port(), spec, out), nprocs=nproc, join=True,
                           start_method="spawn")
        result = json.loads(Path(out, "ddp.json").read_text())
    return result["rows"], result["failures"], result["skipped"]


def format_rows(rows: list[dict], failures: list[dict] = (), skipped: list[dict] = ()) -> str:
    """A plain-text table of :func:`run_ddp`'s result."""
    lines = [f"{'network':<18} {'mode':<11} {'ranks':>5} {'untouched ms':>13} {'patched ms':>11} {'speedup':>8} "
             f"{'pairs quartiles':>16} {'first step s (patched)':>23}"]
    for r in rows:
        q = r.get("speedup_quartiles")
        band = f"{q[0]:.3f}-{q[1]:.3f}" if q else "-"
        lines.append(f"{r['case']:<18} {r['mode'] + ' ' + r['dtype']:<11} {r['ddp']:>5} {r['torch_us'] / 1e3:>13.3f} "
                     f"{r['convt3d_us'] / 1e3:>11.3f} {r['speedup']:>7.3f}x {band:>16} {r['first_step_s']:>23.2f}")
    for f in failures:
        lines.append(f"{f['case']:<18} {f['mode'] + ' ' + f['dtype']:<11} failed: {f['error']}")
    for s in skipped:
        lines.append(f"{s['case']:<18} skipped: {s['reason']}")
    return "\n".join(lines)
