"""The seven KernelBench level-1 ConvTranspose3d problems, as ``KernelBench/level1/`` defines them: each
``Model``'s constructor signature and the arguments it passes to its ``nn.ConvTranspose3d`` (``ModelNew``
copies both), the tiles its file carries and how cuDNN computes its reference with TF32 allowed."""
from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

SEED = 42  # KernelBench's seed_num: models are built after seeding it, trial seeds derive from it
CUDA_PROBLEMS = (77,)  # the problems with a hand-kept CUDA entry (kernelbench/<name>_cuda.py) beside their file


def parameters(signature: str) -> list[inspect.Parameter]:
    """The parameters of ``def f(<signature>)``, their defaults evaluated as literals."""
    args = ast.parse(f"def f({signature}): pass").body[0].args
    defaults = [inspect.Parameter.empty] * (len(args.args) - len(args.defaults))
    defaults += [ast.literal_eval(d) for d in args.defaults]
    return [inspect.Parameter(a.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=d)
            for a, d in zip(args.args, defaults)]


def bind(signature: str, args: tuple, overrides: dict) -> dict[str, Any]:
    """Every parameter's value for ``f(*args, **overrides)`` of ``def f(<signature>)``, as Python binds them."""
    bound = inspect.Signature(parameters(signature)).bind(*args, **overrides)
    bound.apply_defaults()
    return dict(bound.arguments)


_KERNEL = "in_channels: int, out_channels: int, kernel_size: "
# The signature shared by 58, 68 and 72 (tuple arguments) and by 61 and 73 (int arguments).
_TUPLE_SIGNATURE = (_KERNEL + "tuple, stride: tuple = (1, 1, 1), padding: tuple = (0, 0, 0), "
                    "output_padding: tuple = (0, 0, 0), groups: int = 1, bias: bool = False")
_INT_SIGNATURE = (_KERNEL + "int, stride: int = 1, padding: int = 0, output_padding: int = 0, groups: int = 1, "
                  "bias: bool = False")
_ALL_FORWARDED = ("stride", "padding", "output_padding", "groups", "bias")
_ALWAYS_FORWARDED = ("in_channels", "out_channels", "kernel_size")


@dataclass(frozen=True)
class DefaultReference:
    """How cuDNN computed a problem's fp32 reference with TF32 allowed, as measured against float64."""
    tf32: bool  # True: cuDNN computed in TF32; False: in full fp32 although TF32 was allowed
    max_abs_err_fp64: float
    measured: str  # date and conditions


# Where the default-flag references were measured against float64 (KernelBench's inputs, seed-42 weights).
_H200 = "2026-12-01, H200, torch 2.11.0+cu130, cuDNN 9.19"


def _tf32(err: float) -> DefaultReference:
    return DefaultReference(True, err, _H200)


@dataclass(frozen=True)
class Candidate:
    """A tile configuration a file carries (the engine ``Config``'s non-default fields) and its tuner median."""
    config: dict[str, Any] = field(hash=False)
    median_ms: float


# Where the tuner's medians (do_bench, warm L2) were measured, on KernelBench's inputs at each file's
# default-flag precision; a file keeps the fastest two or three within about 15%.
CANDIDATES_MEASURED = "2026-12-05, H200, torch 2.11.0+cu130, triton 3.6.0"


def _flat(median_ms: float, **config) -> Candidate:
    """A flat-kind tile (every file's candidates are) and its tuner median."""
    return Candidate(dict(config, flat=True), median_ms)


@dataclass(frozen=True)
class Problem:
    id: int
    name: str  # KernelBench level-1 file name without ".py"
    signature: str  # Model.__init__(self, ...)'s parameters, as written there
    forwarded: tuple[str, ...]  # the arguments Model passes to nn.ConvTranspose3d besides _ALWAYS_FORWARDED
    init_inputs: tuple  # get_init_inputs()
    input_shape: tuple[int, int, int, int, int]  # get_inputs(): torch.rand of this shape, fp32
    default_reference: DefaultReference  # how cuDNN computed the reference with TF32 allowed
    candidates: tuple[Candidate, ...] = field(default=(), hash=False)  # fastest first

    # Whether the reference computes in TF32 when TF32 is allowed, so the file's forward does too.
    cudnn_uses_tf32 = property(lambda self: self.default_reference.tf32)
    file_name = property(lambda self: self.name + ".py")

    @property
    def cuda_file_name(self) -> str | None:
        """The hand-kept CUDA entry beside the Triton file, where the problem has one."""
        return self.name + "_cuda.py" if self.id in CUDA_PROBLEMS else None

    @property
    def ignored(self) -> tuple[str, ...]:
        """Constructor arguments Model accepts but does not pass on (problem 73's output_padding)."""
        return tuple(name for name in self.bind() if name not in {*_ALWAYS_FORWARDED, *self.forwarded})

    def bind(self, init_inputs: tuple | None = None, **overrides) -> dict[str, Any]:
        """Every constructor argument's value for ``Model(*init_inputs, **overrides)``."""
        return bind(self.signature, self.init_inputs if init_inputs is None else tuple(init_inputs), overrides)

    def layer_args(self, init_inputs: tuple | None = None, **overrides) -> dict[str, Any]:
        """Keyword arguments of the ``nn.ConvTranspose3d`` that ``Model`` builds."""
        bound = self.bind(init_inputs, **overrides)
        return {name: bound[name] for name in (*_ALWAYS_FORWARDED, *self.forwarded)}

    def describe(self) -> str:
        """The layer built and its input, compactly: 'N16 32->64 in 16,32,32 k3 s2 p1 op0 d2 g1'."""
        layer = nn.ConvTranspose3d(**self.layer_args(), device="meta")

        def f(v: tuple) -> str:
            return str(v[0]) if len(set(v)) == 1 else ",".join(map(str, v))

        n, c, *size = self.input_shape
        return (f"N{n} {c}->{layer.out_channels} in {f(tuple(size))} k{f(layer.kernel_size)} s{f(layer.stride)} "
                f"p{f(layer.padding)} op{f(layer.output_padding)} d{f(layer.dilation)} g{layer.groups}")


PROBLEMS: tuple[Problem, ...] = (
    Problem(58, "58_conv_transposed_3D__asymmetric_input__asymmetric_kernel",
            _TUPLE_SIGNATURE, _ALL_FORWARDED, (32, 16, (3, 5, 7)), (16, 32, 16, 32, 64), _tf32(6.9e-4),
            (_flat(1.385, BLOCK_M=128, BLOCK_N=16, BLOCK_K=32, BLOCK_W=128, num_warps=4, num_stages=3),
             _flat(1.423, BLOCK_M=64, BLOCK_N=16, BLOCK_K=32, BLOCK_W=64, num_warps=4, num_stages=4),
             _flat(1.598, BLOCK_M=128, BLOCK_N=16, BLOCK_K=32, BLOCK_W=16, num_warps=4, num_stages=4, gluon=True))),
    Problem(61, "61_conv_transposed_3D__square_input__square_kernel",
            _INT_SIGNATURE, _ALL_FORWARDED, (48, 48, 3), (8, 48, 64, 64, 64), _tf32(4.7e-4),
            (_flat(3.536, BLOCK_M=128, BLOCK_N=64, BLOCK_K=32, BLOCK_W=128, num_warps=4, num_stages=3),
             _flat(3.720, BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, BLOCK_W=128, num_warps=4, num_stages=3),
             _flat(3.806, BLOCK_M=128, BLOCK_N=64, BLOCK_K=32, BLOCK_W=16, num_warps=4, num_stages=4, gluon=True))),
    # 68's get_inputs names its last two sizes (width, height); both are 64.
    Problem(68, "68_conv_transposed_3D__square_input__asymmetric_kernel",
            _TUPLE_SIGNATURE, _ALL_FORWARDED, (32, 64, (3, 5, 5)), (16, 32, 64, 64, 64), _tf32(3.3e-4),
            (_flat(9.261, BLOCK_M=128, BLOCK_N=64, BLOCK_K=32, BLOCK_W=128, num_warps=4, num_stages=3),
             _flat(9.544, BLOCK_M=128, BLOCK_N=64, BLOCK_K=32, BLOCK_W=16, num_warps=4, num_stages=4, gluon=True))),
    Problem(70, "70_conv_transposed_3D__asymmetric_input__square_kernel",
            _KERNEL + "int, stride: int = 1, padding: int = 0, output_padding: int = 0, dilation: int = 1, "
            "groups: int = 1, bias: bool = False",
            ("stride", "padding", "output_padding", "dilation", "groups", "bias"), (48, 24, 3), (8, 48, 96, 96, 96),
            _tf32(7.1e-4),
            (_flat(8.812, BLOCK_M=128, BLOCK_N=32, BLOCK_K=32, BLOCK_W=128, num_warps=4, num_stages=3),
             _flat(9.408, BLOCK_M=128, BLOCK_N=32, BLOCK_K=64, BLOCK_W=128, num_warps=4, num_stages=3))),
    Problem(72, "72_conv_transposed_3D_asymmetric_input_asymmetric_kernel___strided_padded_grouped_",
            _TUPLE_SIGNATURE, _ALL_FORWARDED, (32, 32, (3, 5, 7), (2, 2, 2), (1, 2, 3), (1, 1, 1), 4),
            (8, 32, 12, 24, 48),
            # cuDNN computes this grouped problem in full fp32 even with TF32 allowed: exact grade.
            DefaultReference(False, 2.1e-7, _H200),
            (_flat(0.457, BLOCK_M=128, BLOCK_N=16, BLOCK_K=16, BLOCK_W=128, num_warps=4, num_stages=3, W_GROUP=2,
                   fold=2),
             _flat(0.492, BLOCK_M=128, BLOCK_N=32, BLOCK_K=32, BLOCK_W=128, num_warps=4, num_stages=3, W_GROUP=2,
                   fold=4))),
    Problem(73, "73_conv_transposed_3D_asymmetric_input_square_kernel__strided_padded__grouped",
            _INT_SIGNATURE, ("stride", "padding", "groups", "bias"), (32, 32, 3, 2, 1, 4), (4, 32, 32, 64, 128),
            _tf32(2.5e-4),
            (_flat(0.677, BLOCK_M=128, BLOCK_N=32, BLOCK_K=32, BLOCK_W=128, num_warps=4, num_stages=3, W_GROUP=2),
             _flat(0.727, BLOCK_M=128, BLOCK_N=32, BLOCK_K=32, BLOCK_W=128, num_warps=4, num_stages=4, W_GROUP=2,
                   gluon=True))),
    Problem(77, "77_conv_transposed_3D_square_input_square_kernel___padded____dilated____strided__",
            _KERNEL + "int, stride: int = 1, padding: int = 0, dilation: int = 1, bias: bool = False",
            ("stride", "padding", "dilation", "bias"), (32, 64, 3, 2, 1, 2), (16, 32, 16, 32, 32), _tf32(3.4e-4),
            (_flat(0.350, BLOCK_M=128, BLOCK_N=64, BLOCK_K=32, BLOCK_W=32, num_warps=4, num_stages=4, W_GROUP=2,
                   gluon=True),
             _flat(0.378, BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, BLOCK_W=64, num_warps=4, num_stages=4, W_GROUP=2))),
)

def find(problems: tuple, problem_id: int, level: str = ""):
    """The problem of ``problem_id``, else KeyError naming the known ids (``level``: "level-2 " or empty)."""
    table = {p.id: p for p in problems}
    if problem_id not in table:
        raise KeyError(f"no KernelBench {level}ConvTranspose3d problem {problem_id}; known: {sorted(table)}")
    return table[problem_id]


def by_id(problem_id: int) -> Problem:
    return find(PROBLEMS, problem_id)


def parse_ids(text: str | None) -> list[Problem]:
    """'58,77' -> those problems (all seven for None or empty)."""
    return [by_id(int(v)) for v in text.split(",") if v.strip()] if text else list(PROBLEMS)


class ReferenceModel(nn.Module):
    """KernelBench's ``Model`` for ``problem``, its layer under the same name as in ``ModelNew``."""

    def __init__(self, problem: Problem, *init_inputs, **overrides):
        super().__init__()
        self.conv_transpose3d = nn.ConvTranspose3d(**problem.layer_args(init_inputs or None, **overrides))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv_transpose3d(x)
