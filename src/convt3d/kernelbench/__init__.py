"""KernelBench level-1 ConvTranspose3d deliverables: the problems, the ``ModelNew`` exporter, our static
rules and the evaluator, as submodules; nothing is imported here, so ``convt3d`` stays cheap to import."""
