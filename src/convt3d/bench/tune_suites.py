"""``convt3d tune``: fill the persistent cache by running the bench suites' layers once with
measuring on, so that later processes start fast (``convt3d.tune(model, x)`` does it for a model)."""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch import nn

from ..core.flags import device_name
from ..dispatch import cache
from ..functional import conv_transpose3d
from ..tune import Progress, tune
from . import suites
from .cli import HelpFormatter, add_filters, parse, usage_error
from .roofline import cudnn_tf32


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="convt3d tune", formatter_class=HelpFormatter,
        description="Fill convt3d's persistent cache (auto-backend decisions and Triton tile configs) by running "
                    "the bench suites' layers once with measuring on, so that later processes start fast.",
        epilog="The cache lives in $CONVT3D_CACHE_DIR, else ~/.cache/convt3d/, one JSON file per GPU model, keyed on "
               "the convt3d, torch and triton versions. Tune your own model from Python with "
               "convt3d.tune(model, *example_inputs). Needs a CUDA device (on CPU tensors 'auto' always runs "
               "PyTorch).")
    p.add_argument("--suite", choices=("kernelbench", "layers", "all"), default="all", help="the bench suite")
    add_filters(p, suites.case_names())
    p.add_argument("--backward", action="store_true", help="also run a backward pass per case (training)")
    p.add_argument("--cache-dir", metavar="DIR", help="cache directory (sets CONVT3D_CACHE_DIR)")
    p.add_argument("--list", action="store_true", help="print the selected cases and exit")
    p.add_argument("--show", action="store_true", help="print the cache file of this GPU and exit")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    return p


class _CaseLayer(nn.Module):
    def __init__(self, geometry, w: torch.Tensor, b: torch.Tensor | None, grad: bool):
        super().__init__()
        self.args = geometry.conv_args()
        self.weight = nn.Parameter(w, requires_grad=grad)
        self.bias = None if b is None else nn.Parameter(b, requires_grad=grad)

    def forward(self, x):
        return conv_transpose3d(x, self.weight, self.bias, *self.args)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse(build_parser(), argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    if args.cache_dir:
        os.environ[cache.ENV_DIR] = args.cache_dir
    try:
        cases = suites.select(args.suite, args.case, args.dtype, args.layout, args.precision)
    except ValueError as exc:
        return usage_error(str(exc), "convt3d tune")
    if args.list:
        for c in cases:
            print(f"{c.suite:<12} {c.label}")
        return 0
    if not torch.cuda.is_available():
        print("convt3d tune: no CUDA device: on CPU tensors 'auto' always runs PyTorch, so there is nothing to "
              f"measure; the cache would be {cache.cache_dir()}", file=sys.stderr)
        return 0
    gpu = device_name(torch.device("cuda", torch.cuda.current_device()))
    if args.show:  # the cache file of this GPU
        store = cache.store_for(gpu)
        print(f"{store.path} ({'exists' if store.path.exists() else 'not written yet'}), key {store.key}")
        for sig, e in sorted(store.entries["decisions"].items()):
            t = ", ".join(f"{k} {v:.4g}" for k, v in sorted(e.get("timings_ms", {}).items(), key=lambda kv: kv[1]))
            print(f"  decision {e.get('engine')!s:<6} {sig}  [{t} ms]")
        for key, e in sorted(store.entries["triton_configs"].items()):
            print(f"  triton   {e.get('short', e.get('config'))}  {key}")
        return 0
    if not cases:
        return usage_error("no case matches the filters", "convt3d tune")
    bar = Progress(len(cases), "convt3d tune")
    rows, failures, t0 = [], 0, time.perf_counter()
    try:
        for case in cases:
            bar.status(case.label)
            try:
                t = suites.make_tensors(case, "cuda", args.seed)
                layer = _CaseLayer(case.geometry, t.w, t.b, args.backward)
                x = t.x.requires_grad_(args.backward)
                with cudnn_tf32(case.allow_tf32):
                    # One layer per model: the network check would time that layer again.
                    rep = tune(layer, x, backward=args.backward, progress=False, check=False)
                rows += [(case.label, e) for e in rep.entries]
            except Exception as exc:  # noqa: BLE001 -- report the case, go on with the others
                failures += 1
                print(f"convt3d tune: {case.label}: {type(exc).__name__}: {exc}", file=sys.stderr)
            finally:
                t = layer = x = None
                torch.cuda.empty_cache()
            bar.advance(case.label)
    finally:
        bar.close()
    for label, e in rows:
        times = ", ".join(f"{k} {v:.4g}" for k, v in sorted((e.get("timings_ms") or {}).items(), key=lambda kv: kv[1]))
        print(f"{label:<34} {e['engine']:<6} {e['source']:<14} {times + ' ms' if times else ''}")
    print(f"{len(cases) - failures}/{len(cases)} cases tuned in {time.perf_counter() - t0:.0f} s; cache: "
          f"{cache.file_for(cache.cache_dir(), gpu)}")
    return 0 if failures == 0 else 1
