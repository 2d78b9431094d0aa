"""convt3d: fast, exact-API 3-D transposed convolution for PyTorch.

    import convt3d
    y = convt3d.conv_transpose3d(x, w, b, stride=2, padding=1)   # like F.conv_transpose3d
    layer = convt3d.ConvTranspose3d(64, 32, 3, stride=2)         # like nn.ConvTranspose3d
    convt3d.patch(model)                                         # swap every nn.ConvTranspose3d

Importing convt3d has no side effects beyond registering the ``convt3d::conv_transpose3d`` op.
"""
from .dispatch.select import set_benchmark
from .core.errors import BackendUnavailableError
from .explain import explain
from .functional import conv_transpose3d
from .nn import ConvTranspose3d, patch
from .core.params import ConvT3dParams
from .tune import tune
from .version import __version__

__all__ = ["conv_transpose3d", "ConvTranspose3d", "patch", "ConvT3dParams", "BackendUnavailableError",
           "explain", "tune", "set_benchmark", "__version__"]
