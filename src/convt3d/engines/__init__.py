"""The engines, as peers: ``triton``, ``conv3d`` (stride-1 calls), ``torch`` and ``torch+bwd``
(PyTorch's forward, convt3d's backward); importing this package registers them with the dispatcher
in that order, its order of preference for ties."""
from ..dispatch.registry import register
from .torch.peer import Conv3dEngine, TorchEngine
from .triton.peer import HybridEngine, TritonEngine

for _engine in (TritonEngine(), Conv3dEngine(), TorchEngine(), HybridEngine()):
    register(_engine)
