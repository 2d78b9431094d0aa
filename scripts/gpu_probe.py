"""Design probe for the Triton engine on a GPU (not part of the package; see NOTES.md).

Runs: correctness of a few shapes vs float64 and vs cuDNN's own error; per-config timings of the
main kernel with compiler facts (registers, spills, shared memory, MMA flavour); A/B variants
(input copy on/off); cuDNN times. Prints a compact table; full log to $OUT/probe.json.
"""
import json
import math
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from convt3d import triton_engine as E
from convt3d.validate import check_call

OUT = os.environ.get("OUT", "/tmp")
LOG = {"env": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "cudnn": torch.backends.cudnn.version()}, "rows": []}
which = set(sys.argv[1:])


def log(**kw):
    LOG["rows"].append(kw)
    print(json.dumps(kw), flush=True)


def bench(fn, rep=60):
    return do_bench(fn, warmup=10, rep=rep, return_mode="median") * 1e3  # us


KB = {
    "kb58": (16, 32, 16, (16, 32, 64), (3, 5, 7), 1, 0, 0, 1, 1),
    "kb61": (8, 48, 48, (64, 64, 64), 3, 1, 0, 0, 1, 1),
    "kb68": (16, 32, 64, (64, 64, 64), (3, 5, 5), 1, 0, 0, 1, 1),
    "kb70": (8, 48, 24, (96, 96, 96), 3, 1, 0, 0, 1, 1),
    "kb72": (8, 32, 32, (12, 24, 48), (3, 5, 7), 2, (1, 2, 3), (1, 1, 1), 1, 4),
    "kb73": (4, 32, 32, (32, 64, 128), 3, 2, 1, 0, 1, 1),
    "kb77": (16, 32, 64, (16, 32, 32), 3, 2, 1, 0, 2, 1),
}
LAYERS = {
    "nnunet_128_64": (2, 128, 64, (32, 32, 32), 2, 2, 0, 0, 1, 1),
    "nnunet_64_32": (2, 64, 32, (64, 64, 64), 2, 2, 0, 0, 1, 1),
    "monai_unet_k3": (4, 64, 32, (32, 32, 32), 3, 2, 1, 1, 1, 1),
    "gan_k4s2p1": (8, 256, 128, (16, 16, 16), 4, 2, 1, 0, 1, 1),
    "videogpt_k4s2p3": (4, 240, 240, (10, 34, 34), 4, 2, 3, 0, 1, 1),
    "aniso_122": (2, 256, 128, (8, 64, 64), (1, 2, 2), (1, 2, 2), 0, 0, 1, 1),
    "refine_k3s1": (4, 64, 64, (32, 32, 32), 3, 1, 1, 0, 1, 1),
}


def make(spec, dtype=torch.float32, cl=False, bias=False):
    n, cin, cout, sz, k, s, p, op, d, g = spec
    k3 = (k,) * 3 if isinstance(k, int) else k
    x = torch.rand(n, cin, *sz, device="cuda", dtype=dtype)
    if cl:
        x = x.to(memory_format=torch.channels_last_3d)
    w = (torch.rand(cin, cout // g, *k3, device="cuda", dtype=dtype) - 0.5) * (2 / math.sqrt(cout // g * math.prod(k3)))
    b = torch.randn(cout, device="cuda", dtype=dtype) if bias else None
    return x, w, b, (s, p, op, g, d)


def kinfo(h):
    try:
        ptx = h.asm["ptx"]
        mma = "wgmma" if "wgmma" in ptx else ("mma.sync" if "mma.sync" in ptx else "fma")
        return {"regs": h.n_regs, "spills": h.n_spills, "smem": h.metadata.shared, "mma": mma,
                "tma": "cp.async.bulk.tensor" in ptx}
    except Exception as e:  # noqa
        return {"err": repr(e)}


def probe_case(name, spec, dtype=torch.float32, cl=False, precs=("tf32",), bias=False, all_cfgs=True,
               ab_copy=False, ncfg=2, wg_ab=False, dump=None):
    x, w, b, (s, p, op, g, d) = make(spec, dtype, cl, bias)
    params, _ = check_call(x, w, b, s, p, op, g, d)
    flops = params.useful_flops
    ref = None
    for prec in precs:
        tf32 = prec == "tf32"
        torch.backends.cudnn.allow_tf32 = tf32
        t_cudnn = bench(lambda: F.conv_transpose3d(x, w, b, s, p, op, g, d), rep=100)
        torch.backends.cudnn.allow_tf32 = True
        # accuracy vs float64 (on a subset when huge)
        if ref is None and params.out_shape[0] * math.prod(params.out_shape[1:]) < 6e8:
            ref = F.conv_transpose3d(x.double(), w.double(), None if b is None else b.double(), s, p, op, g, d)
        launch = E.prepare(x, w, b, params, prec)
        t_prep = bench(lambda: E.prepare(x, w, b, params, prec))
        t_copy = bench(lambda: E._prepare_input(x, prec == "tf32" and dtype == torch.float32, True))
        t_pack = bench(lambda: E._pack_weight(w, params, prec == "tf32" and dtype == torch.float32))
        log(case=name, prec=prec, copy_us=round(t_copy, 1), pack_us=round(t_pack, 1),
            copy_floor_us=round(2 * x.numel() * x.element_size() / 4.2e6, 1))
        cfgs = launch.configs if all_cfgs else launch.configs[:ncfg]
        if wg_ab and launch.configs[0].W_GROUP == 2:
            import dataclasses
            cfgs = cfgs + [dataclasses.replace(c, W_GROUP=1) for c in cfgs[:2]]
        best = None
        for cfg in cfgs:
            try:
                t0 = time.perf_counter()
                h = launch.run(cfg)
                torch.cuda.synchronize()
                tc = time.perf_counter() - t0
                t = bench(lambda: launch.run(cfg))
                info = kinfo(h)
                if dump and cfg == cfgs[0]:
                    with open(os.path.join(OUT, f"{dump}_{prec}.ttgir"), "w") as f:
                        f.write(h.asm["ttgir"])
                err = None
                if ref is not None:
                    err = (launch.y.double() - ref).abs().max().item()
                log(case=name, dtype=str(dtype), cl=cl, prec=prec, cfg=cfg.short(), kernel_us=round(t, 1),
                    compile_s=round(tc, 2), tflops=round(flops / t / 1e6, 1), err=err, **info)
                if best is None or t < best[0]:
                    best = (t, cfg)
            except Exception as e:
                log(case=name, cfg=cfg.short(), error=repr(e)[:300])
        t_full = bench(lambda: E.forward(x, w, b, params, prec, config=best[1]))
        cerr = None
        if ref is not None:
            torch.backends.cudnn.allow_tf32 = tf32
            cerr = (F.conv_transpose3d(x, w, b, s, p, op, g, d).double() - ref).abs().max().item()
            torch.backends.cudnn.allow_tf32 = True
            ours = (E.forward(x, w, b, params, prec, config=best[1]).double() - ref).abs().max().item()
        else:
            ours = None
        log(case=name, dtype=str(dtype), cl=cl, prec=prec, SUMMARY=True, cudnn_us=round(t_cudnn, 1),
            best_kernel_us=round(best[0], 1), full_us=round(t_full, 1), prep_us=round(t_prep, 1),
            speedup=round(t_cudnn / t_full, 2), best=best[1].short(), err_ours=ours, err_cudnn=cerr,
            mem_floor_us=round(params.min_bytes(x.element_size()) / 4.3e6, 1))
        if ab_copy:
            # A/B: skip the channels-last copy (kernel reads NCDHW directly)
            launch2 = E.prepare(x, w, b, params, prec)
            orig = E._prepare_input
            try:
                E._prepare_input = lambda xx, r, need_copy: xx
                launch2 = E.prepare(x, w, b, params, prec)
            finally:
                E._prepare_input = orig
            h = launch2.run(best[1])
            t2 = bench(lambda: launch2.run(best[1]))
            e2 = (launch2.y.double() - ref).abs().max().item() if ref is not None else None
            log(case=name, AB="no_input_copy", prec=prec, kernel_us=round(t2, 1), err=e2, **kinfo(h))
    del x, w, b, ref
    torch.cuda.empty_cache()


def overhead():
    import convt3d
    x, w, b, (s, p, op, g, d) = make((1, 16, 16, (4, 4, 4), 2, 2, 0, 0, 1, 1), bias=True)
    params, _ = check_call(x, w, b, s, p, op, g, d)
    E.forward(x, w, b, params, "tf32")
    launch = E.prepare(x, w, b, params, "tf32")
    cfg = launch.configs[0]
    launch.run(cfg)
    n = 200

    def wall(fn):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / n * 1e6

    log(what="cpu_overhead_us", check_call=round(wall(lambda: check_call(x, w, b, s, p, op, g, d)), 1),
        prepare=round(wall(lambda: E.prepare(x, w, b, params, "tf32")), 1),
        run=round(wall(lambda: launch.run(cfg)), 1),
        forward=round(wall(lambda: E.forward(x, w, b, params, "tf32")), 1),
        api=round(wall(lambda: convt3d.conv_transpose3d(x, w, b, s, p, op, g, d)), 1),
        torch=round(wall(lambda: F.conv_transpose3d(x, w, b, s, p, op, g, d)), 1))


def main():
    t0 = time.time()
    overhead()
    # write floor
    y = torch.empty(16 * 64 * 33 * 65 * 65, device="cuda")
    log(what="zero_571MB_us", t=round(bench(lambda: y.zero_()), 1))
    del y
    if not which or "kb77" in which:
        probe_case("kb77", KB["kb77"], precs=("tf32", "tf32x3"), ab_copy=True, wg_ab=True, dump="kb77")
    for name in ("kb73", "kb72", "kb58", "kb61", "kb68", "kb70"):
        if not which or name in which:
            probe_case(name, KB[name], precs=("tf32", "tf32x3"), all_cfgs=(name in ("kb73", "kb58")),
                       wg_ab=(name == "kb73"), dump=("kb68" if name == "kb68" else None))
    for name, spec in LAYERS.items():
        if not which or name in which or "layers" in which:
            probe_case(name, spec, dtype=torch.bfloat16, cl=True, bias=True, all_cfgs=False)
            probe_case(name, spec, dtype=torch.float32, cl=False, bias=True, all_cfgs=False, ncfg=1,
                       ab_copy=name == "nnunet_64_32")
    print("total probe seconds", round(time.time() - t0, 1))


if __name__ == "__main__":
    try:
        main()
    finally:
        with open(os.path.join(OUT, "probe.json"), "w") as f:
            json.dump(LOG, f, indent=1)
