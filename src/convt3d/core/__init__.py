"""The vocabulary every layer speaks: the geometry and its phases, validation with PyTorch's errors, the ``Call``."""
