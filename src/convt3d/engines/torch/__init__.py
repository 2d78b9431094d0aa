"""PyTorch's own call: the baseline of every measurement, and the conv3d form of stride-1 calls."""
