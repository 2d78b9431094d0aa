"""One bench row's call to profile under Nsight Compute (GPU).

Three warm calls first, so that tuning and auto's measurement stay out of the profile, then one
call inside cudaProfilerStart/Stop for ``ncu --profile-from-start off``; the dispatcher's
explanation goes to stderr. The row is a bench case at a dtype, a layout and a precision (tf32:
PyTorch's default flags; tf32x3: ``cudnn.allow_tf32=False``, kernelbench rows only).

    ncu --profile-from-start off --set basic --section MemoryWorkloadAnalysis \\
        python tools/ncu_call.py kernelbench kb61 fp32 ncdhw [BACKEND] [tf32|tf32x3]
"""
from __future__ import annotations

import argparse
import functools
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("suite", help="kernelbench, layers or heads")
    ap.add_argument("name", help="a case of that suite (kb61, aniso_122, ...)")
    ap.add_argument("dtype", help="fp32 or bf16")
    ap.add_argument("layout", help="ncdhw or cl")
    ap.add_argument("backend", nargs="?", default="auto", help="the convt3d backend to call (default auto)")
    ap.add_argument("precision", nargs="?", default="tf32", choices=("tf32", "tf32x3"),
                    help="the row's precision (default tf32)")
    a = ap.parse_args(argv)
    import torch

    import convt3d
    from convt3d.bench import suites

    # Matched by the row's cuDNN flag rather than its spelling: tf32 rows allow TF32, tf32x3 rows do not.
    case = next((c for c in suites.select(a.suite, [a.name], [a.dtype], [a.layout])
                 if c.allow_tf32 == (a.precision == "tf32")), None)
    if case is None:
        raise SystemExit(f"no {a.suite} row {a.name} {a.dtype} {a.layout} at precision {a.precision}")
    torch.backends.cudnn.allow_tf32 = case.allow_tf32
    t, args = suites.make_tensors(case, "cuda"), case.geometry.conv_args()
    call = functools.partial(convt3d.conv_transpose3d, t.x, t.w, t.b, *args, backend=a.backend)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    print(convt3d.explain(t.x, t.w, t.b, *args, backend=None if a.backend == "auto" else a.backend), file=sys.stderr)
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
