"""One bench row's call under Nsight Compute: three warm calls, then one inside
cudaProfilerStart/Stop, so that ``ncu --profile-from-start off`` profiles that call's kernels alone
(the tuning and auto's measurement of a new signature run in the warm calls).

    ncu --profile-from-start off --set basic --section MemoryWorkloadAnalysis \\
        python scripts/ncu_call.py kernelbench kb61 fp32 ncdhw [BACKEND] [default|exact]

The dispatcher's explanation of the call goes to stderr first.
"""
import sys

import torch

import convt3d
from convt3d.bench import suites


def main(argv: list[str]) -> None:
    suite, name, dtype, layout = argv[:4]
    backend = argv[4] if len(argv) > 4 else "auto"
    precision = argv[5] if len(argv) > 5 else "default"
    torch.backends.cudnn.allow_tf32 = precision != "exact"
    case = next(c for c in suites.select(suite, [name], [dtype], [layout], [precision]))
    t = suites.make_tensors(case, "cuda")
    args = case.geometry.conv_args()

    def call():
        return convt3d.conv_transpose3d(t.x, t.w, t.b, *args, backend=backend, precision=None)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    print(convt3d.explain(t.x, t.w, t.b, *args, backend=None if backend == "auto" else backend), file=sys.stderr)
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main(sys.argv[1:])
