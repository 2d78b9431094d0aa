"""Argument checking for conv_transpose3d: invalid input raises here, before any engine runs, with
PyTorch's exception type and wording plus the argument and its value."""
from __future__ import annotations

import numbers
from typing import Any

import torch

from .params import ConvT3dParams
from .memo import memo


def _as_int(value: Any) -> int | None:
    """``value`` as an int the way PyTorch's argument parser reads one (bool refused), else None."""
    if type(value) is int:  # the common case, without the costlier ABC check below
        return value
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point() \
            and not value.is_complex() and value.dtype != torch.bool:
        return int(value.item())
    return None


def triple(name: str, value: Any) -> tuple[int, int, int]:
    """Normalise an int-or-sequence argument to three ints, as PyTorch's argument parser does."""
    # Fast paths for what layers give on every call: small layers are host-bound.
    if type(value) is int:
        return (value,) * 3
    if type(value) is tuple and len(value) == 3 and all(type(v) is int for v in value):
        return value
    single = _as_int(value)
    if single is not None:
        return (single,) * 3
    if not isinstance(value, (tuple, list, torch.Size)):
        raise TypeError(f"conv_transpose3d(): argument '{name}' must be tuple of ints, not {type(value).__name__}")
    items = []
    for pos, v in enumerate(value, start=1):  # 1-based, as PyTorch reports the position
        iv = _as_int(v)
        if iv is None:
            raise TypeError(f"conv_transpose3d(): argument '{name}' must be tuple of ints, "
                            f"but found element of type {type(v).__name__} at pos {pos} ({name}={value!r})")
        items.append(iv)
    if len(items) == 1:
        items = items * 3
    if len(items) != 3:
        raise RuntimeError(f"expected {name} to be a single integer value or a list of 3 values to match the "
                           f"convolution dimensions, but got {name}={list(value)}")
    return tuple(items)


def _type_name(t: torch.Tensor) -> str:
    return f"{t.dtype} on {t.device}"


_valid: dict[tuple, tuple[ConvT3dParams, bool]] = memo("core.validate.valid")


def _argument_key(v: Any) -> Any:
    """Ints or a tuple or list of them as a key hashing by value, else None (a tensor hashes by identity)."""
    if type(v) is int or (type(v) is tuple and all(type(e) is int for e in v)):
        return v
    if type(v) is list and all(type(e) is int for e in v):
        return tuple(v)
    return None


# Other tensor subclasses (fake, distributed, MetaTensor) are checked in full.
_MEMO_TYPES = (torch.Tensor, torch.nn.Parameter)


def memo_arguments(input: Any, weight: Any, bias: Any, stride: Any, padding: Any, output_padding: Any,
                   groups: Any, dilation: Any) -> tuple | None:
    """The geometry arguments as a key hashing by value (this check's memo, the steady path), or None."""
    if type(input) not in _MEMO_TYPES or type(weight) not in _MEMO_TYPES \
            or (bias is not None and type(bias) not in _MEMO_TYPES) or type(groups) is not int:
        return None
    args = (_argument_key(stride), _argument_key(padding), _argument_key(output_padding), _argument_key(dilation))
    return None if None in args else args + (groups,)


def check_call(input: Any, weight: Any, bias: Any, stride: Any, padding: Any, output_padding: Any,
               groups: Any, dilation: Any) -> tuple[ConvT3dParams, bool]:
    """Validate every argument: the geometry and whether the input was unbatched (successes memoised)."""
    key = None
    args = memo_arguments(input, weight, bias, stride, padding, output_padding, groups, dilation)
    if args is not None:
        key = (input.shape, input.dtype, input.device, weight.shape, weight.dtype, weight.device,
               None if bias is None else (bias.shape, bias.dtype, bias.device), args)
        hit = _valid.get(key)
        if hit is not None:
            return hit
    result = _check_call(input, weight, bias, stride, padding, output_padding, groups, dilation)
    if key is not None:
        if len(_valid) >= 4096:
            _valid.clear()
        _valid[key] = result
    return result


def _check_call(input: Any, weight: Any, bias: Any, stride: Any, padding: Any, output_padding: Any,
                groups: Any, dilation: Any) -> tuple[ConvT3dParams, bool]:
    for pos, (name, t) in enumerate((("input", input), ("weight", weight), ("bias", bias)), start=1):
        if not isinstance(t, torch.Tensor) and (t is not None or name != "bias"):
            raise TypeError(f"conv_transpose3d(): argument '{name}' (position {pos}) must be Tensor, "
                            f"not {type(t).__name__}")
    stride, padding, output_padding, dilation = (triple(name, v) for name, v in (
        ("stride", stride), ("padding", padding), ("output_padding", output_padding), ("dilation", dilation)))
    groups, given = _as_int(groups), groups
    if groups is None:
        raise TypeError(f"conv_transpose3d(): argument 'groups' must be int, not {type(given).__name__}")

    if input.dim() not in (4, 5):
        raise RuntimeError("Expected 4D (unbatched) or 5D (batched) input to conv_transpose3d, but got input of "
                           f"size: {list(input.shape)}")
    if weight.dim() != 5:
        raise RuntimeError("expected weight to be 5-D (in_channels, out_channels/groups, kD, kH, kW), but got "
                           f"weight of size {list(weight.shape)}")
    others = (("weight", weight), ("bias", bias))
    for name, t in others:
        if t is not None and t.dtype != input.dtype:
            raise RuntimeError(f"Input type ({_type_name(input)}) and {name} type ({_type_name(t)}) should be the same")
    for name, t in others:
        if t is not None and t.device != input.device:
            raise RuntimeError(f"Input and {name} must be on the same device, but got input on {input.device} and "
                               f"{name} on {t.device}")

    for name, values, least in (("stride", stride, 1), ("dilation", dilation, 1), ("padding", padding, 0),
                                ("output_padding", output_padding, 0)):
        if any(v < least for v in values):
            raise RuntimeError(f"{'non-positive' if least else 'negative'} {name} is not supported: {name}={values}")
    for i, name in enumerate(("depth", "height", "width")):
        if output_padding[i] >= stride[i] and output_padding[i] >= dilation[i]:
            raise RuntimeError("output padding must be smaller than either stride or dilation, but got "
                f"output_padding_{name}: {output_padding[i]} stride_{name}: {stride[i]} dilation_{name}: {dilation[i]} "
                f"(output_padding={output_padding}, stride={stride}, dilation={dilation})")
    if groups <= 0:
        raise RuntimeError(f"non-positive groups is not supported: groups={groups}")

    w_in, cout_g = weight.shape[0], weight.shape[1]
    kernel = tuple(int(k) for k in weight.shape[2:])
    if w_in < groups or w_in % groups != 0:
        raise RuntimeError(f"Given groups={groups}, expected weight to be divisible by {groups} at dimension 0 "
                           f"(at least {groups}), but got weight of size {list(weight.shape)} instead")
    if any(k <= 0 for k in kernel):
        raise RuntimeError(f"expected a positive kernel size, but got weight of size {list(weight.shape)} "
                           f"(kernel_size={kernel})")
    if cout_g == 0:
        raise RuntimeError(f"expected weight to have at least one output channel per group, but got weight of "
                           f"size {list(weight.shape)} (out_channels/groups=0)")

    unbatched = input.dim() == 4
    shape5 = (1,) + tuple(input.shape) if unbatched else tuple(input.shape)
    if shape5[1] != w_in:
        raise RuntimeError(f"Given transposed=1, weight of size {list(weight.shape)}, expected input{list(input.shape)} "
                           f"to have {w_in} channels, but got {shape5[1]} channels instead")
    cout = cout_g * groups
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != cout):
        raise RuntimeError(f"Given transposed=1, weight of size {list(weight.shape)}, expected bias to be 1-dimensional "
                           f"with {cout} elements, but got bias of size {list(bias.shape)} instead")
    if shape5[0] != 0 and any(s == 0 for s in shape5[2:]):
        raise RuntimeError("Only zero batch or zero channel inputs are supported, but got input shape: "
                           f"{list(input.shape)}")

    params = ConvT3dParams.create(shape5[0], w_in, cout, groups, shape5[2:], kernel, stride, padding,
                                  output_padding, dilation)
    out = params.out_size
    if any(o <= 0 for o in out):
        raise RuntimeError(f"Given input size per channel: ({' x '.join(map(str, shape5[2:]))}). Calculated output "
                           f"size per channel: ({' x '.join(map(str, out))}). Output size is too small "
                           f"(stride={stride}, padding={padding}, dilation={dilation}, kernel_size={kernel})")
    return params, unbatched
