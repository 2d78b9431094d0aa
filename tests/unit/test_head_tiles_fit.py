"""Every output-head candidate the tuner is offered fits one block's shared memory: each candidate's
launches are built on meta tensors and its kernels compiled for sm_90a on the Triton installed here
(no GPU). One candidate that does not fit fails at its first launch and takes the whole tuning of its
layer with it; the offer rules (``head.head_smem``, ``_joint_fits``) are estimates, and this holds
them to Triton's own figure.

Run as a script (what the compile test does, in a clean process), it checks the named rows of the
heads sweep in bf16, channels-last, prints each candidate over the limit and "N over"."""
from __future__ import annotations

import random
import sys

import pytest
import torch

from clean_process import compile_in_clean_process
from convt3d.core.params import ConvT3dParams
from convt3d.engines.triton import head as HE
from convt3d.engines.triton.kernels import head_gemm

BLOCK_SMEM = 232448  # cudaDevAttrMaxSharedMemoryPerBlockOptin on the H100 / H200
PTR = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}


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


def launches(params: ConvT3dParams, cfg: HE.HeadConfig, dtype: torch.dtype, precision: str, cl: bool) -> list[tuple]:
    """The kernel launches of ``cfg`` on this layer, as (name, ints, consts, module, tensors),
    from ``HeadSteps.run`` on meta tensors with a site factory that records instead of launching."""
    caught: list[tuple] = []

    class Recorder:
        def __init__(self, name, ints, consts, module):
            self.args = (name, ints, consts, module)

        def launch(self, device, *tensors):
            caught.append(self.args + (tensors,))

    def make_site(key, name, grid, ints, consts, module=None):
        return Recorder(name, ints, consts, module)

    fmt = torch.channels_last_3d if cl else torch.contiguous_format
    steps = HE.HeadSteps(params, cfg, precision, True, make_site,
                         lambda x, round_tf32: x.contiguous(memory_format=torch.channels_last_3d))
    x = torch.empty(params.in_shape, dtype=dtype, device="meta", memory_format=fmt)
    w = torch.empty((params.in_channels, params.out_channels_per_group) + tuple(params.kernel_size), dtype=dtype,
                    device="meta")
    b = torch.empty(params.out_channels, dtype=dtype, device="meta")
    y = torch.empty(params.out_shape, dtype=dtype, device="meta", memory_format=fmt)
    steps.run(x, w, b, y)
    return caught


def shared_bytes(name: str, ints: tuple, consts: dict, module, tensors: tuple, cache: dict) -> int:
    """Triton's shared memory of one launch, compiled for sm_90a once per (kernel, constexprs,
    options, dtypes) in ``cache``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(module or head_gemm, name)
    consts = dict(consts)
    opts = {k: consts.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in consts}
    key = (name, tuple(sorted(consts.items())), tuple(sorted(opts.items())),
           tuple(t.dtype for t in tensors), tuple(abs(v) >= 2**31 for v in ints))
    if key not in cache:
        names = list(fn.arg_names)
        ptrs = names[:len(tensors)]  # the tensors come first in every kernel's signature
        values = iter(ints)
        sig = {n: "constexpr" if n in consts else PTR[tensors[ptrs.index(n)].dtype] if n in ptrs
               else "i64" if abs(next(values)) >= 2**31 else "i32" for n in names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in ptrs}
        ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options=opts)
        cache[key] = ck.metadata.shared
    return cache[key]


def main(names: list[str]) -> int:
    from convt3d.bench import suites

    cache: dict = {}
    over = 0
    for g in [g for g in suites.HEAD_SWEEP if g.name in names]:
        params = ConvT3dParams.create(g.batch, g.in_channels, g.out_channels, g.groups, g.in_size, g.kernel,
                                      g.stride, g.padding, g.output_padding, g.dilation)
        for t in HE.head_tiles(params, torch.bfloat16, "tf32", channels_last=True):
            cfg = HE.HeadConfig(**t)
            for name, ints, consts, module, tensors in launches(params, cfg, torch.bfloat16, "tf32", True):
                shared = shared_bytes(name, ints, consts, module, tensors, cache)
                if shared > BLOCK_SMEM:
                    over += 1
                    print(f"over: {g.name} {cfg.short()}: {name} {shared} B", flush=True)
    print(f"{len(cache)} kernels compiled, {over} over {BLOCK_SMEM} B")
    return 1 if over else 0


@pytest.mark.parametrize("seed", [0, 7])
def test_every_candidate_records_its_launches(seed):
    # Without compiling (so under the interpreter too): every offered candidate of a generated
    # layer yields its kernels' launches, each a kernel of its module with the tensors first.
    for params in generated_layers(seed, 2):
        for dtype in (torch.float32, torch.bfloat16):
            for cl in (True, False):
                for t in HE.head_tiles(params, dtype, "tf32", channels_last=cl):
                    cfg = HE.HeadConfig(**t)
                    found = launches(params, cfg, dtype, "tf32", cl)
                    assert found, cfg.short()
                    for name, ints, consts, module, tensors in found:
                        fn = getattr(module or head_gemm, name)
                        assert all(isinstance(t, torch.Tensor) for t in tensors)
                        assert len(fn.arg_names) >= len(tensors) + len(ints)


def test_generated_layers_are_heads():
    layers = generated_layers(3, 40)
    assert all(1 <= p.out_channels_per_group <= 15 and p.in_channels_per_group >= 8 for p in layers)
    assert len({(p.kernel_size, p.stride) for p in layers}) > 30, "kernels and strides vary"


def test_candidates_fit_shared_memory_when_compiled():
    # The row and dtype whose tuning once failed on a candidate's shared memory (the sweep's
    # 256 -> 7 k6 s2 head in bf16: 504 columns, the widest joint tiles), channels-last. In a
    # process of its own, without the interpreter (clean_process explains why).
    out = compile_in_clean_process([__file__, "sweep09_256to7_k666s222"])
    assert " 0 over " in out, out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
