"""``convt3d.ConvTranspose3d`` (a drop-in subclass of ``torch.nn.ConvTranspose3d``) and ``patch``."""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn
from torch.nn.utils import parametrize

from .functional import conv_transpose3d

__all__ = ["ConvTranspose3d", "patch"]


class ConvTranspose3d(nn.ConvTranspose3d):
    """``torch.nn.ConvTranspose3d`` computed by convt3d: the constructor, parameters, initialisation and
    state_dict are PyTorch's own; ``backend`` and ``precision`` (default None: the package defaults, see
    :func:`convt3d.conv_transpose3d`) choose the engine for this layer."""

    backend: str | None = None
    precision: str | None = None
    # Read by the Python path alone: TorchScript runs PyTorch's own op (``forward``).
    __jit_ignored_attributes__ = ["backend", "precision"]

    def forward(self, input: torch.Tensor, output_size: Optional[List[int]] = None) -> torch.Tensor:
        if self.padding_mode != "zeros":
            raise ValueError("Only `zeros` padding mode is supported for ConvTranspose3d")
        output_padding = self._output_padding(input, output_size, self.stride, self.padding, self.kernel_size, 3,
                                              self.dilation)
        if torch.jit.is_scripting():
            # TorchScript does not run our Python engines: a scripted layer computes as nn.ConvTranspose3d.
            return torch.nn.functional.conv_transpose3d(input, self.weight, self.bias, self.stride, self.padding,
                                                        output_padding, self.groups, self.dilation)
        return self._convt3d_forward(input, output_padding)

    @torch.jit.unused
    def _convt3d_forward(self, input: torch.Tensor, output_padding: List[int]) -> torch.Tensor:
        return conv_transpose3d(input, self.weight, self.bias, self.stride, self.padding, output_padding,
                                self.groups, self.dilation, backend=self.backend, precision=self.precision)

    def extra_repr(self) -> str:
        chosen = [f", {k}={getattr(self, k)!r}" for k in ("backend", "precision") if getattr(self, k) is not None]
        return super().extra_repr() + "".join(chosen)


def patch(model: nn.Module, *, backend: str | None = None, precision: str | None = None) -> nn.Module:
    """Swap every ``nn.ConvTranspose3d`` inside ``model`` (``model`` itself included) for :class:`ConvTranspose3d`, in
    place, parametrized ones (spectral or weight norm through ``torch.nn.utils.parametrizations``) included; an
    ``nn.LazyConvTranspose3d`` not yet built becomes one at its first call. Other subclasses of ``nn.ConvTranspose3d``
    are left alone.

    The same parameter and buffer objects are kept (optimisers holding them keep working), with their hooks and training
    mode. Returns ``model``. On a CUDA machine it also starts, in a background thread, Triton's once-per-process setup.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"patch() expects an nn.Module, but got {type(model).__name__}")
    from .engines.triton.warm_up import start_warm_up

    start_warm_up()
    for module in model.modules():
        cls = type(module)
        if cls is nn.ConvTranspose3d:
            module.__class__ = ConvTranspose3d
        elif cls is nn.LazyConvTranspose3d:
            # It turns into ``cls_to_become`` at its first call: ours instead.
            module.cls_to_become = ConvTranspose3d
        elif _parametrized_convt(module):
            # parametrize's class for one module rebuilt on ours: the same properties and hooks, our forward
            # (``remove_parametrizations`` rolls a module back to ours).
            module.__class__ = type(cls.__name__, (ConvTranspose3d,),
                                    {k: v for k, v in cls.__dict__.items() if k not in ("__dict__", "__weakref__")})
        else:
            continue
        if backend is not None:
            module.backend = backend
        if precision is not None:
            module.precision = precision
    return model


def _parametrized_convt(module: nn.Module) -> bool:
    """A plain nn.ConvTranspose3d under ``torch.nn.utils.parametrize``: its class is the one-module
    subclass parametrize made, holding only the parametrized tensors' properties and copy hooks."""
    cls = type(module)
    return (cls.__bases__ == (nn.ConvTranspose3d,) and "forward" not in cls.__dict__
            and parametrize.is_parametrized(module))
