"""H200 probe of the output-head rows of the layers suite (``head_*``): forward times of the Triton
engine's head configurations and of its untuned default against cuDNN, the memory floor, and
PyTorch's backward of the same layers (dX = conv3d(dY, W), dW, and the autograd step).

    PYTHONPATH=src python3 scripts/gpu_head_probe.py OUT.json [--no-backward] [--heads-only]   # every head row
    PYTHONPATH=src python3 scripts/gpu_head_probe.py OUT.json --one NAME DTYPE LAYOUT [--kind KIND]   # for ncu
    PYTHONPATH=src python3 scripts/gpu_head_probe.py OUT.json --grads   # the head gradient kernels alone
    ... [--rows NAME/DTYPE/LAYOUT,...]   # only these rows (e.g. head_gan_64to1/bf16/cl)

``--grads``: per head row, the kernel time (CUDA-graph replay) of every head dX and dW candidate
(``head_backward``; each with its dY copy and weight packing), of every "rows" forward tile, and
of cuDNN's dX and dW, with each one's error against float64.

``--kind``: with ``--one``, run the first head configuration of that kind (gather, rows, direct,
fused, box, shuffle) instead of the first of any kind; without, time that kind's tiles only; ``--persist``: the first persistent one
(``Config.persist``); ``--packed``: the first on the packed weight (``Config.w_packed``);
``--tile SHORT``: the configuration whose ``Config.short()`` is SHORT (e.g. "head-rows M256 N128 K16
W128 R2048 w8 s3 wpk").

Times are medians of triton.testing.do_bench in one process; "graph" times replay the call in a
CUDA graph (kernel time without the host); "api" is the public function, backend="triton", after
the engine's own tuning on its first call (the steady path a user gets).
"""
from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench, do_bench_cudagraph

import convt3d
from convt3d import triton_engine as E
from convt3d.bench import suites
from convt3d.validate import check_call

COPY_BW = 4.24e12  # H200 device-to-device copy, read + write bytes (shared/CONTEXT.md)


def _ms(fn, graph=False):
    fn()
    torch.cuda.synchronize()
    if graph:
        return do_bench_cudagraph(fn, rep=40)
    return do_bench(fn, warmup=10, rep=40, return_mode="median")


def _rel(a, ref):
    """Largest |a - ref| over the largest |ref|, in float64."""
    ref = ref.double()
    return ((a.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _rows(only=None, chosen=None):
    """The head rows (``only``: one (name, dtype, layout); ``chosen``: a set of them)."""
    for g in suites.LAYERS:
        if not g.name.startswith("head_"):
            continue
        for dt in suites.DTYPES:
            for lay in suites.LAYOUTS:
                if (only is None or only == (g.name, dt, lay)) and (chosen is None or (g.name, dt, lay) in chosen):
                    yield suites.Case("layers", g, dt, lay, "default", "randn")


def probe(case, forward_only=False, with_backward=True, with_default=True, kind=None, persist=False,
          packed=False, tile=None):
    g = case.geometry
    t = suites.make_tensors(case, "cuda")
    args = g.conv_args()
    params, _ = check_call(t.x, t.w, t.b, *args)
    es = t.x.element_size()
    prec = "tf32"
    row = dict(case=case.name, dtype=case.dtype, layout=case.layout,
               floor_us=params.min_bytes(es, t.b is not None) / COPY_BW * 1e6)
    ref = F.conv_transpose3d(t.x, t.w, t.b, *args)
    configs = E.plan(params, t.x, t.w, prec).configs
    if forward_only:  # under ncu: the first head config, a few calls
        cfg = next(c for c in configs if c.head and kind in (None, c.head) and (c.persist or not persist)
                   and (c.w_packed or not packed) and tile in (None, c.short()))
        for _ in range(3):
            E.forward(t.x, t.w, t.b, params, prec, config=cfg)
        torch.cuda.synchronize()
        return row
    row["cudnn_us"] = _ms(lambda: F.conv_transpose3d(t.x, t.w, t.b, *args)) * 1e3
    row["cudnn_graph_us"] = _ms(lambda: F.conv_transpose3d(t.x, t.w, t.b, *args), graph=True) * 1e3
    row["configs"] = {}
    best, best_us = None, float("inf")
    for i, cfg in enumerate(configs):
        if not cfg.head and (i > 0 or not with_default):
            continue  # the phase path: its untuned default only (the tuner's other tiles are timed elsewhere)
        if cfg.head and kind is not None and cfg.head != kind:
            continue  # --kind: that kind's tiles only
        y = E.forward(t.x, t.w, t.b, params, prec, config=cfg)
        err = _rel(y, ref)
        us = _ms(lambda: E.forward(t.x, t.w, t.b, params, prec, config=cfg), graph=True) * 1e3
        row["configs"][cfg.short()] = dict(graph_us=us, rel_diff_vs_cudnn=err)
        if cfg.head and us < best_us:
            best, best_us = cfg, us
    if best is not None:
        row["best_head"] = best.short()
        try:
            # The public path with the engine's own tuning (every candidate timed on the first call).
            E.clear_caches()
            y = convt3d.conv_transpose3d(t.x, t.w, t.b, *args, backend="triton")
            rec = E.tuning_log()[E.plan(params, t.x, t.w, prec).tune_key]
            row["api_config"], row["tuning_s"] = rec.config.short(), rec.seconds
            row["api_us"] = _ms(lambda: convt3d.conv_transpose3d(t.x, t.w, t.b, *args, backend="triton")) * 1e3
            row["api_rel_diff_vs_cudnn"] = _rel(y, ref)
            row["speedup_vs_cudnn"] = row["cudnn_us"] / row["api_us"]
            row["pct_of_floor"] = 100 * row["floor_us"] / row["api_us"]
        except Exception as e:  # the public path (dispatch) is not what this probe measures
            row["api_error"] = repr(e)
    if not with_backward:
        return row
    # PyTorch's backward of the layer (cuDNN): dX, dW separately and the autograd step.
    x = t.x.detach().requires_grad_(True)
    w = t.w.detach().requires_grad_(True)
    b = None if t.b is None else t.b.detach().requires_grad_(True)
    y = F.conv_transpose3d(x, w, b, *args)
    dy = torch.randn_like(y)
    s, p, op, groups, d = args
    row["bwd_dx_us"] = _ms(lambda: F.conv3d(dy, t.w, None, s, p, d, groups)) * 1e3
    row["bwd_dw_us"] = _ms(lambda: torch.ops.aten.convolution_backward(
        dy, t.x, t.w, None, s, p, d, True, op, groups, [False, True, False])) * 1e3
    row["bwd_step_us"] = _ms(lambda: torch.autograd.grad(y, [x, w] + ([b] if b is not None else []), dy,
                                                         retain_graph=True)) * 1e3
    nx, ny, nw = t.x.numel(), y.numel(), t.w.numel()
    row["floor_dx_us"] = (ny + nw + nx) * es / COPY_BW * 1e6  # read dY, W; write dX
    row["floor_dw_us"] = (ny + nx + nw) * es / COPY_BW * 1e6  # read dY, X; write dW
    row["floor_bwd_us"] = (ny + 2 * nx + nw) * es / COPY_BW * 1e6  # one pass: read dY, X; write dX
    return row


def grads(case):
    """Kernel times of the head dX / dW candidates and rows forward tiles of one row (``--grads``)."""
    from convt3d import head_backward as HB
    from convt3d.backward import grad_formats

    g = case.geometry
    t = suites.make_tensors(case, "cuda")
    args = g.conv_args()
    params, _ = check_call(t.x, t.w, t.b, *args)
    prec = "tf32"
    row = dict(case=case.name, dtype=case.dtype, layout=case.layout)
    y = F.conv_transpose3d(t.x, t.w, t.b, *args)
    dy = torch.randn_like(y)
    s, p, op, groups, d = args
    row["cudnn_dx_us"] = _ms(lambda: F.conv3d(dy, t.w, None, s, p, d, groups), graph=True) * 1e3
    row["cudnn_dw_us"] = _ms(lambda: torch.ops.aten.convolution_backward(
        dy, t.x, t.w, None, s, p, d, True, op, groups, [False, True, False]), graph=True) * 1e3
    fx = grad_formats(t.x, t.w)[0]
    ref_dx = F.conv3d(dy.double(), t.w.double(), None, s, p, d, groups)
    ref_dw = torch.ops.aten.convolution_backward(dy.double(), t.x.double(), t.w.double(), None, s, p, d, True, op,
                                                 groups, [False, True, False])[1]

    if HB.supports(params):
        for cfg in HB.dgrad_candidates(params, t.w.dtype, t.x.device):
            fn = lambda cfg=cfg: HB.head_dgrad(dy, t.w, params, prec, t.x.dtype, cfg, fx)  # noqa: E731
            row[f"dx {cfg.short()}"] = dict(us=_ms(fn, graph=True) * 1e3, rel=_rel(fn(), ref_dx))
        for cfg in HB.wgrad_candidates(params, t.x.dtype, t.x.device):
            fn = lambda cfg=cfg: HB.head_wgrad(dy, t.x, params, prec, t.w.dtype, cfg)  # noqa: E731
            row[f"dw {cfg.short()}"] = dict(us=_ms(fn, graph=True) * 1e3, rel=_rel(fn(), ref_dw))
    for cfg in E.plan(params, t.x, t.w, prec).configs:
        if cfg.head == "rows":
            fn = lambda cfg=cfg: E.forward(t.x, t.w, t.b, params, prec, config=cfg)  # noqa: E731
            row[f"fwd {cfg.short()}"] = dict(us=_ms(fn, graph=True) * 1e3, rel=_rel(fn(), y))
    return row


def _run(out, cases, measure):
    """``measure(case)`` of every case, a JSON line each as it comes, then all of them to ``out``."""
    rows = []
    for case in cases:
        try:
            rows.append(measure(case))
        except Exception as e:  # a failing row must not hide the others' numbers
            rows.append(dict(case=case.name, dtype=case.dtype, layout=case.layout, error=repr(e)))
        print(json.dumps(rows[-1]), flush=True)
        E.clear_caches()
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


def main(argv):
    out = argv[0]
    chosen = ({tuple(r.split("/")) for r in argv[argv.index("--rows") + 1].split(",")} if "--rows" in argv
              else None)
    if "--grads" in argv:
        # The two combinations the training-step bench times (--mode full): bf16 channels-last, fp32 NCDHW.
        _run(out, (c for c in _rows(chosen=chosen) if (c.dtype, c.layout) in (("bf16", "cl"), ("fp32", "ncdhw"))),
             grads)
        return
    only = tuple(argv[2:5]) if len(argv) > 1 and argv[1] == "--one" else None
    with_backward = "--no-backward" not in argv
    kind = argv[argv.index("--kind") + 1] if "--kind" in argv else None
    _run(out, _rows(only, chosen), lambda case: probe(case, forward_only=only is not None, with_backward=with_backward,
                                              with_default="--heads-only" not in argv, kind=kind,
                                              persist="--persist" in argv, packed="--packed" in argv,
                                              tile=argv[argv.index("--tile") + 1] if "--tile" in argv else None))


if __name__ == "__main__":
    main(sys.argv[1:])
