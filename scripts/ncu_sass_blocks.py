"""Where a kernel's instructions and shared-memory traffic go, from Nsight Compute's per-SASS
source counters: consecutive instructions executed equally often form one basic block, and the
blocks are listed by their share of the executed instructions (with their stall samples and
most frequent opcodes), then the shared-memory wavefronts by opcode.

    ncu --section SourceCounters -k regex:head_shuffle -c 1 -o rep python3 scripts/gpu_cuda_head.py ...
    ncu -i rep.ncu-rep --page source --csv --print-source sass > rep_sass.csv
    python3 scripts/ncu_sass_blocks.py rep_sass.csv --top 12
"""
from __future__ import annotations

import argparse
import collections
import csv


def _opcode(source: str) -> str:
    words = source.strip().split()
    if not words:
        return ""
    op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return op


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--top", type=int, default=12, help="blocks to list")
    args = ap.parse_args(argv)
    rows = list(csv.reader(open(args.csv, newline="")))
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
    for b in blocks[:args.top]:
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
