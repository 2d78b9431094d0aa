"""Registers, spills and shared memory of one Triton kernel tile for sm_90a, offline: no GPU needed.

Compiles the kernel with ``triton.compile`` for a ``GPUTarget("cuda", 90, 32)`` (Triton's own code
generation, down to PTX) and runs the CUDA toolkit's ``ptxas -v`` on the PTX. It answers "does this
tile spill?" on a CPU machine; the figures are those of the Triton installed here, so run it with
the GPU machine's Triton version (a venv beside this one): Triton versions can lay out the same
tile differently, and differ by more than a few registers. The PTX version line is lowered to
what the local ptxas reads.

    PYTHONPATH=src python3 tools/ptxas_regs.py convt3d.engines.triton.kernels.head_grad:head_dgrad_kernel \\
        --ptr '*bf16' --const PRECISION=tf32 ROUND_TF32=0 TWO_LEVEL=0 BIG=0 BLOCK_M=128 BLOCK_N=64 BLOCK_K=32 \\
        --warps 4 --stages 1

``--ptr`` is the type of every pointer argument (``*bf16``, ``*fp16``, ``*fp32``), except those
named with ``--ptr-arg NAME=TYPE``; every other non-constexpr argument is an i32. Constexpr values
are integers (0/1 for flags) or strings; ``--div16 NAME...`` marks integer arguments Triton would
specialise as multiples of 16; ``--warps``, ``--stages`` and ``--maxnreg`` are the launch options;
``--ir DIR`` also writes the TTGIR and PTX. Prints one line: registers, spill stores/loads (bytes),
shared memory (bytes).
"""
from __future__ import annotations

import argparse
import importlib
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def _value(text: str):
    if text.lstrip("-").isdigit():
        v = int(text)
        return bool(v) if v in (0, 1) and text in ("0", "1") else v
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kernel", help="module:function of a @triton.jit kernel")
    ap.add_argument("--ptr", default="*fp32", help="type of the pointer arguments (default *fp32)")
    ap.add_argument("--ptr-arg", nargs="*", default=[], metavar="NAME=TYPE", help="per-pointer types")
    ap.add_argument("--const", nargs="*", default=[], metavar="NAME=VALUE", help="constexpr arguments")
    ap.add_argument("--div16", nargs="*", default=[], metavar="NAME",
                    help="integer arguments known to be multiples of 16, as Triton specialises them at a "
                         "launch (pointers are taken as 16-byte aligned, as PyTorch allocates them; an "
                         "integer equal to 1 is passed with --const NAME=1)")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=1)
    ap.add_argument("--maxnreg", type=int, help="register cap per thread (Triton's launch option maxnreg)")
    ap.add_argument("--ptxas", default=shutil.which("ptxas") or "/usr/local/cuda/bin/ptxas")
    ap.add_argument("--ir", metavar="DIR", help="also write Triton's TTGIR and PTX of the tile into DIR")
    args = ap.parse_args(argv)

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    mod_name, fn_name = args.kernel.split(":")
    fn = getattr(importlib.import_module(mod_name), fn_name)
    consts = {k: _value(v) for k, v in (c.split("=", 1) for c in args.const)}
    ptrs = dict(p.split("=", 1) for p in args.ptr_arg)
    sig = {n: ("constexpr" if n in consts else ptrs.get(n, args.ptr) if n.endswith("_ptr") else "i32")
           for n in fn.arg_names}
    # Launch-time specialisation: 16-byte aligned pointers and the --div16 integers.
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in consts and (n.endswith("_ptr") or n in args.div16)}
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": args.warps, "num_stages": args.stages,
                                       **({"maxnreg": args.maxnreg} if args.maxnreg else {})})
    out = subprocess.run([args.ptxas, "--version"], capture_output=True, text=True).stdout
    have = re.search(r"release (\d+)\.(\d+)", out)
    ptx = compiled.asm["ptx"]
    if args.ir:
        Path(args.ir).mkdir(parents=True, exist_ok=True)
        Path(args.ir, f"{fn_name}.ttgir").write_text(compiled.asm["ttgir"])
        Path(args.ir, f"{fn_name}.ptx").write_text(ptx)
    if have:  # CUDA 13.0's ptxas reads PTX ISA up to 9.0
        ptx = re.sub(r"^\.version \d+\.\d+", f".version {9 if int(have.group(1)) >= 13 else 8}.0", ptx,
                     flags=re.M)
    with tempfile.TemporaryDirectory() as d:
        src = Path(d, "k.ptx")
        src.write_text(ptx)
        res = subprocess.run([args.ptxas, "-arch=sm_90a", "-v", str(src), "-o", str(Path(d, "k.cubin"))],
                             capture_output=True, text=True)
    if res.returncode != 0:
        print(res.stderr.strip(), file=sys.stderr)
        return res.returncode
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", res.stderr)
    smem = re.search(r"(\d+) bytes smem", res.stderr)
    print(f"{fn_name} warps={args.warps} stages={args.stages} {consts}: registers {regs.group(1) if regs else '?'}, "
          f"spill stores/loads {spill.group(1) if spill else 0}/{spill.group(2) if spill else 0} B, "
          f"smem {smem.group(1) if smem else 0} B, shared by Triton {compiled.metadata.shared} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
