"""The CUDA C++ engine: kernels built with nvcc and launched from Python."""
