"""KernelBench level-1 ConvTranspose3d deliverables: the problems, the exporter of self-contained
``ModelNew`` files (``convt3d export-kernelbench``), our implementation of KernelBench's static
rules, and an evaluator that follows KernelBench's method (``convt3d kernelbench``).

Nothing is imported here, so ``convt3d`` stays cheap to import; use the submodules.
"""
