"""KernelBench ConvTranspose3d deliverables (levels 1 and 2): the problems, the ``ModelNew`` exporters, our static
rules and the evaluators, as submodules; nothing is imported here, so ``convt3d`` stays cheap to import."""
