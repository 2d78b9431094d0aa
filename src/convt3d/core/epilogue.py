"""The epilogue vocabulary: at most ``MAX_OPS`` elementwise steps, ``(name,)`` or ``(name, operand)``, over a float32
value ``v`` and a register ``r`` (``save``: r = v; ``mul_saved``, ``add_saved``), applied to the convolution's output
before its only store (``conv_transpose3d(..., epilogue=...)``) and by the finishing kernels. ``mul``, ``add`` and
``div`` take a number, ``C`` per-channel values in any shape, or for ``add`` a tensor of the output's shape (a
residual). ``softmax`` normalises over the channels of each position: fused only where one GEMM tile holds them all,
never in a finishing kernel. The kernels receive the program as one compile-time integer (``encode``), its scalars as a
float32 vector and its per-channel operands as a float32 ``[MAX_OPS, C]`` table; ``apply_torch`` runs it in PyTorch."""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch
import torch.nn.functional as F

MAX_OPS = 8
BITS = 5

# Name -> code; the operand each takes: "scalar", "value" (a number or per-channel), "add"
# (also a residual tensor), "slope" (optional number) or None. Codes 1-31 (0 ends the program).
OPS = {
    "mul": (1, "value"), "add": (3, "add"), "div": (19, "value"),
    "clamp_min": (6, "scalar"), "clamp_max": (7, "scalar"),
    "relu": (8, None), "leaky_relu": (9, "slope"), "gelu": (10, None), "gelu_tanh": (11, None),
    "silu": (12, None), "hardswish": (13, None), "sigmoid": (14, None), "tanh": (15, None),
    "save": (16, None), "mul_saved": (17, None), "add_saved": (18, None), "softmax": (21, None),
}
# Codes of the operand forms: per-channel mul/add/div and the residual add.
MUL_C, ADD_C, ADD_T, DIV_C = 2, 4, 5, 20
SCALAR, CHANNEL, TENSOR = "scalar", "channel", "tensor"


@dataclass(frozen=True)
class Step:
    """One validated step: its kernel code, its operand's form and the operand."""

    name: str
    code: int
    form: str | None  # None, SCALAR, CHANNEL or TENSOR
    operand: object = None


@dataclass(frozen=True)
class Epilogue:
    """A validated program; ``signature`` is what a compiled kernel depends on (codes and forms)."""

    steps: tuple[Step, ...]

    @property
    def code(self) -> int:
        return encode(self)

    @property
    def residual(self) -> torch.Tensor | None:
        return next((s.operand for s in self.steps if s.form == TENSOR), None)

    @property
    def signature(self) -> tuple:
        return tuple((s.code, s.form) for s in self.steps)

    def __bool__(self) -> bool:
        return bool(self.steps)

    @property
    def over_channels(self) -> bool:
        """A step reads every channel of a position (the channel softmax)."""
        return any(s.name == "softmax" for s in self.steps)

    def scalars(self, device: torch.device) -> torch.Tensor:
        """The float32 vector of each step's scalar (0 where a step has none)."""
        vals = [float(s.operand) if s.form == SCALAR else 0.0 for s in self.steps]
        return torch.tensor(vals + [0.0] * (MAX_OPS - len(vals)), dtype=torch.float32, device=device)

    def channels(self, channels: int, device: torch.device) -> torch.Tensor:
        """The float32 ``[MAX_OPS, channels]`` table of per-channel operands (row i: step i)."""
        table = torch.zeros((MAX_OPS, channels), dtype=torch.float32, device=device)
        for i, s in enumerate(self.steps):
            if s.form == CHANNEL:
                table[i] = s.operand.reshape(channels)
        return table


def _step(item, channels: int | None, out_shape: tuple | None) -> Step:
    if isinstance(item, str):
        item = (item,)
    if not isinstance(item, (tuple, list)) or not item or not isinstance(item[0], str) or len(item) > 2:
        raise TypeError(f"epilogue: each step must be a name or a (name, operand) pair, but got {item!r}")
    name = item[0]
    if name not in OPS:
        raise ValueError(f"epilogue: unknown step {name!r}; expected one of {sorted(OPS)}")
    code, kind = OPS[name]
    operand = item[1] if len(item) == 2 else None
    if kind is None:
        if operand is not None:
            raise TypeError(f"epilogue: step {name!r} takes no operand, but got {operand!r}")
        return Step(name, code, None)
    if operand is None:
        if kind == "slope":
            return Step(name, code, SCALAR, 0.01)
        raise TypeError(f"epilogue: step {name!r} needs an operand")
    if isinstance(operand, numbers.Real) and not isinstance(operand, bool):
        if name == "div" and operand == 0:
            raise ValueError("epilogue: step 'div' by zero")
        return Step(name, code, SCALAR, float(operand))
    if not isinstance(operand, torch.Tensor) or kind in ("scalar", "slope"):
        raise TypeError(f"epilogue: step {name!r} takes a number, but got {type(operand).__name__}")
    if operand.is_complex() or not operand.is_floating_point():
        raise TypeError(f"epilogue: step {name!r} takes a floating tensor, but got dtype {operand.dtype}")
    if kind == "add" and out_shape is not None and tuple(operand.shape) == tuple(out_shape):
        return Step(name, ADD_T, TENSOR, operand)
    if channels is not None and operand.numel() == channels:
        return Step(name, {"mul": MUL_C, "add": ADD_C, "div": DIV_C}[name], CHANNEL, operand)
    raise ValueError(f"epilogue: step {name!r} takes a number, a tensor of {channels} per-channel values"
                     + (" or a tensor of the output's shape" if kind == "add" else "")
                     + f", but got a tensor of shape {tuple(operand.shape)}")


def as_epilogue(program, channels: int | None = None, out_shape: tuple | None = None) -> Epilogue:
    """A program (steps, an ``Epilogue`` or None) validated for the output; TypeError or ValueError name the step."""
    if program is None:
        return Epilogue(())
    if isinstance(program, Epilogue):
        return program
    if isinstance(program, (str, tuple)) and program and isinstance(program[0], str):
        program = [program]  # one step
    steps = tuple(_step(item, channels, out_shape) for item in program)
    if len(steps) > MAX_OPS:
        raise ValueError(f"epilogue: at most {MAX_OPS} steps, but got {len(steps)}")
    if sum(s.form == TENSOR for s in steps) > 1:
        raise ValueError("epilogue: at most one residual tensor")
    return Epilogue(steps)


def encode(epi: Epilogue) -> int:
    """The program as the kernels' compile-time integer: step i's code in bits [5i, 5i + 5)."""
    return sum(s.code << (BITS * i) for i, s in enumerate(epi.steps))


# The steps in PyTorch: those of an operand, those of the register and those of neither.
_BINARY = {"mul": torch.mul, "add": torch.add, "div": torch.div, "leaky_relu": F.leaky_relu,
           "clamp_min": lambda v, a: torch.clamp(v, min=a), "clamp_max": lambda v, a: torch.clamp(v, max=a)}
_SAVED = {"mul_saved": torch.mul, "add_saved": torch.add}
_UNARY = {"relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda v: F.gelu(v, approximate="tanh"), "silu": F.silu,
          "hardswish": F.hardswish, "sigmoid": torch.sigmoid, "tanh": torch.tanh}


def apply_torch(y: torch.Tensor, epi: Epilogue, channel_dim: int = 1) -> torch.Tensor:
    """The program in PyTorch, computed in float32 and returned in ``y``'s dtype."""
    v = y.float()
    r = v
    for s in epi.steps:
        a = s.operand
        if s.form == CHANNEL:
            a = a.reshape(-1).float().reshape([-1 if d == channel_dim % v.dim() else 1 for d in range(v.dim())])
        elif s.form == TENSOR:
            a = a.float()
        if s.name == "save":
            r = v
        elif s.name == "softmax":
            v = torch.softmax(v, dim=channel_dim)
        elif s.name in _SAVED:
            v = _SAVED[s.name](v, r)
        elif s.name in _UNARY:
            v = _UNARY[s.name](v)
        else:
            v = _BINARY[s.name](v, a)
    return v.to(y.dtype)
