"""Nsight Compute helpers: one bench row's call to profile, and where a profiled kernel's
instructions go.

Profile one call (GPU): three warm calls (tuning and auto's measurement run there), then one inside
cudaProfilerStart/Stop for ``ncu --profile-from-start off``; the dispatcher's explanation goes to
stderr. Arguments: SUITE NAME DTYPE LAYOUT [BACKEND (default auto)] [PRECISION (default or exact)].

    ncu --profile-from-start off --set basic --section MemoryWorkloadAnalysis \\
        python tools/ncu_call.py kernelbench kb61 fp32 ncdhw [BACKEND] [default|exact]

Read a SASS report (``--sass``, no GPU): consecutive instructions executed equally often form one
basic block, listed by share of the executed instructions (with stall samples and top opcodes),
then the shared-memory wavefronts by opcode.

    ncu --section SourceCounters -k regex:KERNEL -c 1 -o rep python tools/ncu_call.py kernelbench kb61 fp32 ncdhw
    ncu -i rep.ncu-rep --page source --csv --print-source sass > rep_sass.csv
    python tools/ncu_call.py --sass rep_sass.csv --top 12
"""
from __future__ import annotations

import argparse
import collections
import csv
import sys


def profile_call(suite: str, name: str, dtype: str, layout: str, backend: str = "auto",
                 precision: str = "default") -> None:
    import torch

    import convt3d
    from convt3d.bench import suites

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


def _opcode(source: str) -> str:
    words = source.strip().split()
    if not words:
        return ""
    return words[1] if words[0].startswith("@") and len(words) > 1 else words[0]


def sass_blocks(path: str, top: int) -> None:
    """The hot basic blocks and the shared-memory wavefronts by opcode of an ncu SASS CSV."""
    rows = list(csv.reader(open(path, newline="")))
    header, data = rows[1], rows[2:]
    col = {name: header.index(name) for name in ("Source", "Instructions Executed",
                                                  "Warp Stall Sampling (All Samples)", "L1 Wavefronts Shared")}
    count = lambda r, name: int(r[col[name]]) if r[col[name]].isdigit() else 0  # noqa: E731
    total = sum(count(r, "Instructions Executed") for r in data)
    samples = sum(count(r, "Warp Stall Sampling (All Samples)") for r in data) or 1
    print(f"{total} instructions executed, {samples} stall samples, {len(data)} SASS lines")
    blocks: list[dict] = []
    for i, r in enumerate(data):
        c, op = count(r, "Instructions Executed"), _opcode(r[col["Source"]]).split(".")[0]
        if blocks and blocks[-1]["count"] == c:
            b = blocks[-1]
        else:
            b = dict(start=i, count=c, length=0, samples=0, ops=collections.Counter())
            blocks.append(b)
        b["length"] += 1
        b["samples"] += count(r, "Warp Stall Sampling (All Samples)")
        b["ops"][op] += 1
    blocks = sorted((b for b in blocks if b["count"]), key=lambda b: -b["count"] * b["length"])
    for b in blocks[:top]:
        ops = ", ".join(f"{k} {v}" for k, v in b["ops"].most_common(6))
        print(f"line {b['start']:5d}: {b['length']:4d} instructions x {b['count']:9d} = "
              f"{100 * b['count'] * b['length'] / total:5.1f}% of executed, {100 * b['samples'] / samples:5.1f}% "
              f"of samples ({ops})")
    waves = collections.Counter()
    for r in data:
        waves[_opcode(r[col["Source"]])] += count(r, "L1 Wavefronts Shared")
    all_waves = sum(waves.values()) or 1
    print(f"shared-memory wavefronts: {all_waves}")
    for op, v in waves.most_common(8):
        if v:
            print(f"  {op:24s} {v:10d} {100 * v / all_waves:5.1f}%")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("call", nargs="*", metavar="SUITE NAME DTYPE LAYOUT [BACKEND] [PRECISION]",
                    help="the bench row to profile")
    ap.add_argument("--sass", metavar="CSV", help="ncu --page source --csv --print-source sass output to read")
    ap.add_argument("--top", type=int, default=12, help="basic blocks to list (with --sass)")
    args = ap.parse_args(argv)
    if args.sass:
        sass_blocks(args.sass, args.top)
        return 0
    if not 4 <= len(args.call) <= 6:
        ap.error("give SUITE NAME DTYPE LAYOUT [BACKEND] [PRECISION], or --sass CSV")
    profile_call(*args.call)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
