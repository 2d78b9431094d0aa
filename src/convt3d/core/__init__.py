"""The vocabulary every layer speaks: the convolution's parameters (phases, taps, compact grids,
the GEMM map), argument validation with PyTorch's errors, the validated ``Call`` and its precision."""
