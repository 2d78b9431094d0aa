"""The engines, as peers: PyTorch's own call (``torch``), the Triton kernels (``triton``) and the
CUDA head kernel (``cuda``); each declares what it supports and runs through one custom op."""
