"""The engines, as peers: the Triton kernels (``triton``), the CUDA head kernel (``cuda``), the
conv3d form of stride-1 calls (``conv3d``), PyTorch's own call (``torch``), and PyTorch's forward
with convt3d's backward for training steps (``torch+bwd``). Each declares what it supports and
runs through one custom op (``convt3d.engines.op``); importing this package registers them with
the dispatcher in that order, its order of preference for ties."""
from ..dispatch.registry import register
from .cuda.peer import CudaEngine
from .torch.peer import Conv3dEngine, TorchEngine
from .triton.peer import HybridEngine, TritonEngine

for _engine in (TritonEngine(), CudaEngine(), Conv3dEngine(), TorchEngine(), HybridEngine()):
    register(_engine)
