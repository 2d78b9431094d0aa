"""Shared memory of every output-head candidate, offline: no GPU needed.

The offer rules (``head_smem``, ``_joint_fits``) estimate shared memory, and a candidate over a
block's limit fails at its first launch, with it its layer's tuning. So for each layer this builds
every candidate's launches (``HeadSteps.run`` on meta tensors), compiles each kernel for sm_90a and
compares Triton's ``metadata.shared`` with ``--limit``. Layers: head rows of the layers suite and the
heads sweep (``--suite``, ``--case``) or ``--count`` drawn from ``--seed``. Run without TRITON_INTERPRET.

    PYTHONPATH=src python3 tools/head_tiles_smem.py --seed 1 --count 5
    PYTHONPATH=src python3 tools/head_tiles_smem.py --suite heads --dtypes bf16

Prints each candidate over the limit and a summary; exits 1 if any is over.
"""
from __future__ import annotations

import argparse
import random
import sys
import time

import torch

from convt3d.engines.triton import head as HE
from convt3d.engines.triton.kernels import head_gemm
from convt3d.core.params import ConvT3dParams

H200_BLOCK_SMEM = 232448  # cudaDevAttrMaxSharedMemoryPerBlockOptin on the H100 / H200
_PTR = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def generated_layers(seed: int, count: int) -> list[ConvT3dParams]:
    """``count`` head layers drawn from ``seed``: per dimension a kernel of 1-6, a stride of 1-4,
    any padding below the kernel and output padding below the stride; groups 1 or 2; 8-320 input
    and 1-15 output channels per group; sizes 4-40; batch 1-4."""
    rng = random.Random(seed)
    out: list[ConvT3dParams] = []
    while len(out) < count:
        k = tuple(rng.choice([1, 2, 3, 4, 5, 6]) for _ in range(3))
        s = tuple(rng.choice([1, 2, 2, 3, 4]) for _ in range(3))
        p = tuple(rng.randint(0, k[i] - 1) for i in range(3))
        op = tuple(rng.randint(0, s[i] - 1) for i in range(3))
        g = rng.choice([1, 1, 1, 2])
        cin = g * rng.choice([8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 320])
        cout = g * rng.randint(1, 15)
        size = tuple(rng.randint(4, 40) for _ in range(3))
        if any((size[i] - 1) * s[i] - 2 * p[i] + k[i] + op[i] < 1 for i in range(3)):
            continue  # an empty output: not a layer
        out.append(ConvT3dParams.create(rng.randint(1, 4), cin, cout, g, size, k, s, p, op, (1, 1, 1)))
    return out


def suite_layers(suite: str | None = None, names: list[str] | None = None) -> list[ConvT3dParams]:
    """The heads sweep (``suite`` "heads"), the layers suite's head rows ("layers"), or the rows
    of either named in ``names``."""
    from convt3d.bench import suites

    layer_heads = [g for g in suites.LAYERS if g.name.startswith("head_")]
    geos = ([g for g in layer_heads + list(suites.HEAD_SWEEP) if g.name in names] if names else
            suites.HEAD_SWEEP if suite == "heads" else layer_heads)
    if names and len(geos) != len(set(names)):
        raise SystemExit(f"unknown head rows: {sorted(set(names) - {g.name for g in geos})}")
    return [ConvT3dParams.create(g.batch, g.in_channels, g.out_channels, g.groups, g.in_size, g.kernel, g.stride,
                                 g.padding, g.output_padding, g.dilation) for g in geos]


class _Compiler:
    """Triton's shared memory of a launch (kernel name, integer arguments, constexprs, module,
    tensors), compiled for sm_90a once per (kernel, constexprs, options, dtypes)."""

    def __init__(self):
        self.cache: dict[tuple, int] = {}

    def shared(self, name: str, ints: tuple, consts: dict, module, tensors: tuple) -> int:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        fn = getattr(module or head_gemm, name)
        consts = dict(consts)
        opts = {k: consts.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in consts}
        key = (name, tuple(sorted(consts.items())), tuple(sorted(opts.items())),
               tuple(t.dtype for t in tensors), tuple(abs(v) >= 2**31 for v in ints))
        if key not in self.cache:
            names = list(fn.arg_names)
            ptrs = names[:len(tensors)]  # the tensors come first in every kernel's signature
            values = iter(ints)
            sig = {n: "constexpr" if n in consts else _PTR[tensors[ptrs.index(n)].dtype] if n in ptrs
                   else "i64" if abs(next(values)) >= 2**31 else "i32" for n in names}
            attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in ptrs}
            ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                                target=GPUTarget("cuda", 90, 32), options=opts)
            self.cache[key] = ck.metadata.shared
        return self.cache[key]


def launches(params: ConvT3dParams, cfg: HE.HeadConfig, dtype: torch.dtype, precision: str, cl: bool) -> list[tuple]:
    """The kernel launches of ``cfg`` on this layer, as (name, ints, consts, module, tensors),
    from ``HeadSteps.run`` on meta tensors with a site factory that records instead of launching."""
    caught: list[tuple] = []

    class _Recorder:
        def __init__(self, name, ints, consts, module):
            self.args = (name, ints, consts, module)

        def launch(self, device, *tensors):
            caught.append(self.args + (tensors,))

    def make_site(key, name, grid, ints, consts, module=None):
        return _Recorder(name, ints, consts, module)

    fmt = torch.channels_last_3d if cl else torch.contiguous_format
    steps = HE.HeadSteps(params, cfg, precision, True, make_site,
                         lambda x, round_tf32, cl_copy: x.contiguous(memory_format=torch.channels_last_3d))
    x = torch.empty(params.in_shape, dtype=dtype, device="meta", memory_format=fmt)
    w = torch.empty((params.in_channels, params.out_channels_per_group) + tuple(params.kernel_size), dtype=dtype,
                    device="meta")
    b = torch.empty(params.out_channels, dtype=dtype, device="meta")
    y = torch.empty(params.out_shape, dtype=dtype, device="meta", memory_format=fmt)
    steps.run(x, w, b, y)
    return caught


def check(layers: list[ConvT3dParams], dtypes: list[torch.dtype], layouts: list[bool], limit: int,
          out=sys.stdout) -> list[tuple]:
    """Every head candidate of every (layer, dtype, layout): the launches whose kernels need more
    than ``limit`` bytes of shared memory, as (layer, dtype, channels-last, config, kernel, bytes)."""
    comp, over, n, t0 = _Compiler(), [], 0, time.time()
    for params in layers:
        for dtype in dtypes:
            for cl in layouts:
                for t in HE.head_tiles(params, dtype, "tf32", channels_last=cl):
                    cfg = HE.HeadConfig(**t)
                    for name, ints, consts, module, tensors in launches(params, cfg, dtype, "tf32", cl):
                        n += 1
                        shared = comp.shared(name, ints, consts, module, tensors)
                        if shared > limit:
                            over.append((params, dtype, cl, cfg.short(), name, shared))
                            print(f"over: {params.in_shape} -> {params.out_shape} k{params.kernel_size} "
                                  f"s{params.stride} g{params.groups} {dtype} {'cl' if cl else 'ncdhw'} "
                                  f"{cfg.short()}: {name} {shared} B", file=out, flush=True)
    print(f"{len(layers)} layers, {n} launches, {len(comp.cache)} kernels compiled, {len(over)} over "
          f"{limit} B, {time.time() - t0:.0f} s", file=out)
    return over


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", choices=["heads", "layers"], help="the heads sweep or the layers suite's head rows")
    ap.add_argument("--case", help="comma-separated head rows of either suite (e.g. head_128to8_k3)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the generated layers")
    ap.add_argument("--count", type=int, default=None,
                    help="generated layers (default 3 without --suite or --case, else none)")
    ap.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32 (at TF32), bf16, fp16")
    ap.add_argument("--layouts", default="cl,ncdhw", help="comma-separated: cl, ncdhw")
    ap.add_argument("--limit", type=int, default=H200_BLOCK_SMEM, help="bytes of shared memory a block may take")
    args = ap.parse_args(argv)
    named = suite_layers(args.suite, args.case.split(",") if args.case else None) if args.suite or args.case else []
    count = args.count if args.count is not None else (0 if named else 3)
    layers = named + generated_layers(args.seed, count)
    over = check(layers, [_DTYPES[d] for d in args.dtypes.split(",")],
                 [lay == "cl" for lay in args.layouts.split(",")], args.limit)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
