"""Tuning table of one GPU: the Triton tuner's timing of every candidate on layers no suite holds,
the data the config predictor ranks from (``convt3d/engines/triton/tables/``).

Compiles every candidate of ``--count`` seeded layers in ``--workers`` processes sharing one Triton
cache, then times them one layer at a time as the exhaustive tuner does, appending one JSON line per
layer (each candidate's GPU median and host ms, the choice, cuDNN's ms) until ``--deadline``. GPU only.

    python tools/tuning_table.py table.jsonl --count 120 --seed 1 --workers 12 --deadline 420
    python tools/tuning_table.py suites.jsonl --suite layers,kernelbench   # the suites' own rows
    python tools/tuning_table.py --merge table.jsonl [more.jsonl ...]   # rewrite the shipped tables
    python tools/tuning_table.py --evaluate table.jsonl   # leave-one-out: what the shortlist loses (CPU)
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import multiprocessing as mp
import os
import random
import sys
import time
from pathlib import Path

# (kernel, stride, padding, output_padding, dilation) per axis, as decoders use them.
AXES = [(2, 2, 0, 0, 1), (4, 2, 1, 0, 1), (3, 2, 1, 1, 1), (3, 1, 1, 0, 1), (3, 2, 0, 0, 1), (5, 2, 2, 1, 1),
        (4, 4, 0, 0, 1), (3, 3, 0, 0, 1), (1, 1, 0, 0, 1), (3, 1, 2, 0, 2), (2, 1, 0, 0, 1), (4, 2, 2, 0, 1)]
CHANNELS = [16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512]


def draw(rng: random.Random) -> dict:
    """One random layer within a size budget (output elements and MACs)."""
    while True:
        kind = rng.choices(["gemm", "head", "grouped", "narrow"], weights=[55, 25, 12, 8])[0]
        cin, cout, groups = rng.choice(CHANNELS), rng.choice(CHANNELS), 1
        if kind == "head":
            cout, cin = rng.choice([1, 1, 2, 3, 4, 6, 8, 12, 15]), rng.choice(CHANNELS[:9])
        elif kind == "grouped":
            groups = rng.choice([2, 4, 8, 16])
            cin, cout = groups * rng.choice([2, 4, 8, 16, 32]), groups * rng.choice([2, 4, 8, 16, 32])
        elif kind == "narrow":
            cin, cout = rng.choice([4, 8, 12, 16]), rng.choice([8, 16, 24])
        ax = rng.choice(AXES)
        axes = [ax] * 3
        if rng.random() < 0.2:  # depth kept (video) or mixed
            axes[0] = rng.choice([(1, 1, 0, 0, 1), (3, 1, 1, 0, 1), ax])
        d = rng.choice([2, 4, 5, 8, 12, 16, 24, 32])
        hw = rng.choice([4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64])
        n = rng.choice([1, 1, 2, 2, 4, 8])
        size = (d, hw, hw if rng.random() < 0.8 else max(2, hw // 2))
        out = [(i - 1) * s - 2 * p + dl * (k - 1) + op + 1 for i, (k, s, p, op, dl) in zip(size, axes)]
        if min(out) < 1:
            continue
        elems = n * cout * math.prod(out)
        macs = n * cin * math.prod(size) * cout * math.prod(a[0] for a in axes) // groups
        if not (2**18 <= elems <= 2**25 and macs <= 3e10):
            continue
        dtype = rng.choices(["float32", "bfloat16", "float16"], weights=[45, 40, 15])[0]
        precision = rng.choices(["tf32", "tf32x3"], weights=[70, 30])[0] if dtype == "float32" else "tf32"
        return dict(batch=n, in_channels=cin, out_channels=cout, groups=groups, in_size=size,
                    kernel_size=[a[0] for a in axes], stride=[a[1] for a in axes], padding=[a[2] for a in axes],
                    output_padding=[a[3] for a in axes], dilation=[a[4] for a in axes], dtype=dtype,
                    precision=precision, channels_last=rng.random() < 0.5)


def _tensors(spec: dict):
    import torch

    dt = getattr(torch, spec["dtype"])
    x = torch.randn(spec["batch"], spec["in_channels"], *spec["in_size"], device="cuda", dtype=dt)
    w = torch.randn(spec["in_channels"], spec["out_channels"] // spec["groups"], *spec["kernel_size"],
                    device="cuda", dtype=dt) * 0.1
    b = torch.randn(spec["out_channels"], device="cuda", dtype=dt)
    if spec["channels_last"]:
        x, w = (t.to(memory_format=torch.channels_last_3d) for t in (x, w))
    return x, w, b


def _compile(specs: list[dict]) -> None:
    """Worker: run every candidate of each layer once (compiles into the shared Triton cache)."""
    from convt3d.engines.triton import engine, predict

    for spec in specs:
        with contextlib.suppress(Exception):  # a layer or candidate that fails is recorded when timed
            x, w, b = _tensors(spec)
            params = predict.params_of(spec)
            for cfg in engine.plan(params, x, w, spec["precision"]).configs:
                with contextlib.suppress(Exception):
                    engine.forward(x, w, b, params, spec["precision"], config=cfg)
        engine.clear_caches()


def _time(spec: dict) -> dict:
    import torch
    from convt3d.core.flags import cudnn_conv_tf32
    from convt3d.dispatch.timing import gpu_ms
    from convt3d.engines.triton import engine, predict

    x, w, b = _tensors(spec)
    params = predict.params_of(spec)
    engine.clear_caches()
    pl = engine.plan(params, x, w, spec["precision"])
    t0 = time.perf_counter()
    engine.forward(x, w, b, params, spec["precision"])
    torch.cuda.synchronize()
    rec = engine.tuning_log()[pl.tune_key]
    cands = [dict(kind=type(c).__name__, config=dataclasses.asdict(c), short=c.short(),
                  ms=rec.timings_ms.get(c.short()), host_ms=rec.host_ms.get(c.short())) for c in pl.configs]
    with cudnn_conv_tf32(spec["precision"] == "tf32"):
        cudnn = gpu_ms(lambda: torch.nn.functional.conv_transpose3d(
            x, w, b, spec["stride"], spec["padding"], spec["output_padding"], spec["groups"], spec["dilation"]))
    return dict(spec, gpu=torch.cuda.get_device_name(), arch="sm%d%d" % torch.cuda.get_device_capability(),
                candidates=cands, choice=rec.config.short(), failed=rec.failed,
                tuning_s=round(time.perf_counter() - t0, 3), cudnn_ms=cudnn)


def geometry_spec(g, **rest) -> dict:
    """A bench suite's geometry as a layer spec, with ``rest`` (dtype, layout, ...)."""
    return dict(batch=g.batch, in_channels=g.in_channels, out_channels=g.out_channels, groups=g.groups,
                in_size=g.in_size, kernel_size=g.kernel, stride=g.stride, padding=g.padding,
                output_padding=g.output_padding, dilation=g.dilation, **rest)


def collect(args) -> None:
    os.environ["CONVT3D_TUNE"] = "exhaustive"  # every candidate timed, here and in the spawned workers
    if args.suite:  # the suites' own rows, for checking the predictor
        from convt3d.bench.suites import select

        specs = [geometry_spec(c.geometry, dtype=str(c.torch_dtype).replace("torch.", ""), precision=c.precision,
                               channels_last=c.layout == "cl", name=c.label)
                 for name in args.suite.split(",") for c in select(name)]
    else:
        rng = random.Random(args.seed)
        specs = [draw(rng) for _ in range(args.count)]
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(args.workers) as pool:
        pool.map(_compile, [specs[i::args.workers] for i in range(args.workers)], chunksize=1)
    print(f"compiled {len(specs)} layers in {time.perf_counter() - t0:.0f} s", flush=True)
    with open(args.out, "a") as f:
        for i, spec in enumerate(specs):
            if time.perf_counter() - t0 > args.deadline:
                print(f"deadline: {i} of {len(specs)} layers timed", flush=True)
                break
            try:
                row = _time(spec)
            except Exception as e:  # a layer the engine cannot run here: recorded, not fatal
                row = dict(spec, error=f"{type(e).__name__}: {e}"[:300])
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(i, row.get("choice", row.get("error")), flush=True)


def evaluate(paths: list[str]) -> None:
    """Each recorded layer ranked from the others: the cost of the shortlist's best against the
    exhaustive best, per shortlist size (the shipped rule is predict.SHORTLIST, one per family first)."""
    import tempfile
    from unittest import mock

    import torch
    from convt3d.engines.triton import predict

    rows = [json.loads(line) for path in paths for line in open(path)]
    rows = [r for r in rows if any(c.get("ms") for c in r.get("candidates", []))]
    # The table of these runs, not the shipped one.
    with tempfile.TemporaryDirectory() as tmp, mock.patch.object(predict, "TABLES", Path(tmp)):
        predict.write_tables(paths)
        table = json.loads(next(Path(tmp).glob("*.json")).read_text())["layers"]
    for k in (1, 2, 3, 4):
        predict.SHORTLIST, losses = k, []
        for i, r in enumerate(rows):
            cands = [c for c in r["candidates"] if c.get("ms")]
            cost = [predict.charged_ms(c) for c in cands]
            configs = tuple(c["config"] for c in cands)
            order = predict.rank(configs, predict.params_of(r), getattr(torch, r["dtype"]), r["precision"],
                                 r["channels_last"], table[:i] + table[i + 1:])
            losses.append(min(cost[j] for j in predict.pick(configs, order)) / min(cost))
        geo = math.exp(sum(map(math.log, losses)) / len(losses))
        print(f"shortlist {k}: {len(rows)} layers, geomean loss {100 * (geo - 1):.2f}%, "
              f"over 3% on {sum(v > 1.03 for v in losses)}, worst {max(losses):.3f}x")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", help="JSONL file to append to")
    p.add_argument("--count", type=int, default=120)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    p.add_argument("--suite", help="time a bench suite's rows (e.g. layers,kernelbench) instead of random layers")
    p.add_argument("--deadline", type=float, default=420.0, help="seconds after which no layer starts")
    p.add_argument("--merge", nargs="+", metavar="JSONL", help="write the shipped tables from these runs")
    p.add_argument("--evaluate", nargs="+", metavar="JSONL", help="leave-one-out loss of the shortlist on these runs")
    args = p.parse_args(argv)
    if args.evaluate:
        evaluate(args.evaluate)
    elif args.merge:
        from convt3d.engines.triton.predict import write_tables

        print(write_tables(args.merge))
    elif not args.out:
        p.error("the output file is required")
    else:
        collect(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
