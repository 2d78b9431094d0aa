"""The Triton engine: phase-decomposed implicit GEMMs (pointer, TMA and Gluon box forms), the
output-head kernels, their tuner and configurations, and the backward kernels."""
