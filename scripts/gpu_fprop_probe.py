"""Is cuDNN's forward conv3d (a stride-1 transposed conv rewritten as a correlation with the
flipped, transposed weight) faster than cuDNN's own conv_transpose3d on the same problem? It
measures the PyTorch candidate a conv3d rewrite would give auto on the stride-1 KernelBench
problems (58, 61, 68, 70) and a bf16 refine layer.

Run on the GPU machine:

    PYTHONPATH=src python3 scripts/gpu_fprop_probe.py

Stride 1 only: conv_transpose3d(x, w, padding=p, dilation=d) equals
conv3d(x, w.flip(2,3,4).transpose(0,1), padding=d*(k-1)-p, dilation=d) (groups 1).
Prints the GPU, torch and cuDNN versions, then per case do_bench medians (us) of both calls at
default flags and with TF32 off, their ratio, and the max abs difference of the two outputs.
"""
import torch
import torch.nn.functional as F
import triton.testing

CASES = {  # name: N, Cin, Cout, (D,H,W), kernel, padding
    "kb58": (16, 32, 16, (16, 32, 64), (3, 5, 7), (0, 0, 0)),
    "kb61": (8, 48, 48, (64, 64, 64), (3, 3, 3), (0, 0, 0)),
    "kb68": (16, 32, 64, (64, 64, 64), (3, 5, 5), (0, 0, 0)),
    "kb70": (8, 48, 24, (96, 96, 96), (3, 3, 3), (0, 0, 0)),
    "refine_bf16": (4, 64, 64, (32, 32, 32), (3, 3, 3), (1, 1, 1)),
}


def main():
    print(torch.cuda.get_device_name(), torch.__version__, torch.backends.cudnn.version(), flush=True)
    for name, (n, ci, co, sp, k, p) in CASES.items():
        dt = torch.bfloat16 if "bf16" in name else torch.float32
        x = torch.rand(n, ci, *sp, device="cuda", dtype=dt)
        w = torch.randn(ci, co, *k, device="cuda", dtype=dt) * 0.05
        wf = w.flip(2, 3, 4).transpose(0, 1).contiguous()
        pf = tuple(kk - 1 - pp for kk, pp in zip(k, p))
        for tf32 in (True, False):
            if dt != torch.float32 and not tf32:
                continue
            torch.backends.cudnn.allow_tf32 = tf32
            a = F.conv_transpose3d(x, w, padding=p)
            b = F.conv3d(x, wf, padding=pf)
            diff = (a.float() - b.float()).abs().max().item()
            t_t = triton.testing.do_bench(lambda: F.conv_transpose3d(x, w, padding=p), warmup=20, rep=150)
            t_f = triton.testing.do_bench(lambda: F.conv3d(x, wf, padding=pf), warmup=20, rep=150)
            print(f"{name:12s} tf32={tf32!s:5s} convT {t_t*1e3:9.1f} us  conv3d {t_f*1e3:9.1f} us  "
                  f"ratio {t_t/t_f:5.2f}x  maxdiff {diff:.2e}", flush=True)
            del a, b
    torch.backends.cudnn.allow_tf32 = True


if __name__ == "__main__":
    main()
