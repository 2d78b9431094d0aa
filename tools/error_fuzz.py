"""The error fuzz (GPU): convt3d's error against PyTorch's own call's, on random layers no suite holds.

Each of ``--count`` seeded layers (``tuning_table.draw``: decoder shapes, heads, grouped, dilated and depth-kept layers;
fp32, bf16 and fp16; both layouts) runs under the flags its draw names (fp32 "tf32": PyTorch's default, TF32 allowed;
"tf32x3": TF32 off): PyTorch's call, ``convt3d.conv_transpose3d`` (auto, its decision final: ``CONVT3D_FIRST_CALL=wait``
unless set, since a background first call is PyTorch's), the Triton engine itself (``backend="triton"``) where it takes
the layer, and the float64 result. An error is max |y - y64| over max |y64|. The budget is twice PyTorch's own error,
and at least one unit in the last place of the dtype at the output's largest magnitude, for auto's output and the Triton
engine's; where PyTorch's fp32 call computed in TF32 (it differs from its exact-fp32 call by more than
``FP32_CLASS_TOL`` of the output), that is the TF32 budget. Exits 1 if any layer is over it.

    python tools/error_fuzz.py --count 150 --seed 7 --json fuzz.json --deadline 540
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

from tuning_table import _tensors, draw


SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def computed_in_tf32(theirs, exact, ref, allow_tf32: bool) -> bool:
    """Whether PyTorch's fp32 call (``theirs``) computed in TF32: allowed, and away from its exact-fp32 output."""
    import torch

    from convt3d.engines.torch.peer import FP32_CLASS_TOL

    scale = ref.abs().max().item() or 1.0
    return theirs.dtype == torch.float32 and allow_tf32 and (
        (theirs.double() - exact.double()).abs().max().item() > FP32_CLASS_TOL * scale)


def judge(theirs, ours, exact, ref, allow_tf32: bool, engine_out=None) -> dict:
    """The verdict on one layer from PyTorch's output (``theirs``), convt3d's, PyTorch's exact-fp32
    output (``exact``, fp32 only), the float64 ``ref`` and (where it ran) the Triton engine's output."""
    import torch

    scale = ref.abs().max().item() or 1.0
    err = lambda y: (y.double() - ref).abs().max().item() / scale  # noqa: E731
    theirs_err, ours_err = err(theirs), err(ours)
    budget = max(2 * theirs_err, torch.finfo(theirs.dtype).eps)
    engine_err = None if engine_out is None else err(engine_out)
    return dict(torch_err=theirs_err, convt3d_err=ours_err, triton_err=engine_err, budget=budget,
                torch_class=None if theirs.dtype != torch.float32 else
                "tf32" if computed_in_tf32(theirs, exact, ref, allow_tf32) else "exact",
                within=max(ours_err, engine_err or 0.0) <= budget)


def run_layer(spec: dict) -> dict:
    import torch
    import torch.nn.functional as F

    import convt3d
    from convt3d.core.flags import cudnn_conv_tf32

    x, w, b = _tensors(spec)
    args = (spec["stride"], spec["padding"], spec["output_padding"], spec["groups"], spec["dilation"])
    allow = spec["precision"] == "tf32"
    with cudnn_conv_tf32(False):
        exact = F.conv_transpose3d(x, w, b, *args) if x.dtype == torch.float32 else None
    ref = F.conv_transpose3d(x.double(), w.double(), b.double(), *args)
    with cudnn_conv_tf32(allow):
        theirs = F.conv_transpose3d(x, w, b, *args)
        ours = convt3d.conv_transpose3d(x, w, b, *args)
        engine = convt3d.explain(x, w, b, *args).engine
        # The engine named: at exact grade where PyTorch's TF32-allowed call computed in full fp32, as auto runs it.
        exact_grade = x.dtype == torch.float32 and not computed_in_tf32(theirs, exact, ref, allow)
        try:
            engine_out = convt3d.conv_transpose3d(x, w, b, *args, backend="triton",
                                                  precision="tf32x3" if exact_grade else None)
        except convt3d.BackendUnavailableError:
            engine_out = None
    return dict(judge(theirs, ours, exact, ref, allow, engine_out), engine=engine)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=150, help="layers to draw (default 150)")
    ap.add_argument("--seed", type=int, default=7, help="the draw's seed (default 7)")
    ap.add_argument("--deadline", type=float, default=float("inf"), help="seconds after which no layer starts")
    ap.add_argument("--json", help="write every layer's spec and verdict here")
    a = ap.parse_args(argv)
    os.environ.setdefault("CONVT3D_FIRST_CALL", "wait")
    rng, t0, rows = random.Random(a.seed), time.perf_counter(), []
    for i in range(a.count):
        spec = draw(rng)
        if time.perf_counter() - t0 > a.deadline:
            break
        try:
            row = dict(spec, **run_layer(spec))
        except Exception as exc:  # noqa: BLE001 -- a layer that fails is reported, and counts as over budget
            row = dict(spec, error=f"{type(exc).__name__}: {exc}"[:300], within=False)
        rows.append(row)
        print(f"{i:3d} {SHORT[spec['dtype']]} {spec['precision']:6s} {spec['in_channels']:3d}->"
              f"{spec['out_channels']:<3d} g{spec['groups']} k{spec['kernel_size']} s{spec['stride']} "
              + (f"{row['engine']:8s} torch {row['torch_err']:.2e} ({row['torch_class'] or '-'}) convt3d "
                 f"{row['convt3d_err']:.2e} triton " + ("-" if row["triton_err"] is None else f"{row['triton_err']:.2e}")
                 + f" budget {row['budget']:.2e}" if "error" not in row else row["error"])
              + ("" if row["within"] else "  OVER"), flush=True)
    over = [r for r in rows if not r["within"]]
    worst = max((max(r["convt3d_err"], r["triton_err"] or 0.0) / r["budget"] for r in rows if "budget" in r),
                default=0.0)
    ran = sum(r.get("triton_err") is not None for r in rows)
    print(f"{len(rows)} layers ({ran} on the Triton engine too), {len(over)} over budget; worst error {worst:.2f}x "
          "its budget")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
