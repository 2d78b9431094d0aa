"""Triton kernels of convt3d (pure ``@triton.jit`` functions; host logic lives in ``convt3d.engines.triton.engine``)."""
