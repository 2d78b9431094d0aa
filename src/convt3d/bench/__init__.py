"""``convt3d bench``: the measuring stick every performance claim of convt3d comes from.

Modules (nothing heavy is imported here; rich and matplotlib load only when a command needs them):

* :mod:`.suites` -- the bench cases (KernelBench problems, real decoder layers), filters, input
  tensors, and the reduced geometry used by the CPU interpreter check;
* :mod:`.roofline` -- device ceilings (measured once per process) and the floor arithmetic;
* :mod:`.runner` -- GPU timing of convt3d against PyTorch/cuDNN, one row per case;
* :mod:`.stats` -- how repeated rounds are read (the lowest, confirmed by the next lowest), for
  the bench and for "auto"'s measurement;
* :mod:`.check` -- without CUDA: correctness of the Triton kernels through Triton's interpreter;
* :mod:`.report` -- environment, rich tables, summary, JSON and the plot;
* :mod:`.cli` -- ``convt3d bench`` options (``main(argv)``).
"""
