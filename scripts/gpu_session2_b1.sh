#!/usr/bin/env bash
# Session 2, GPU call B1: every GPU test file, then the KernelBench suite of the bench. Logs to $OUT.
export PYTHONPATH=src PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/tex
CONVT3D_AUTOTUNE=0 timeout 170 python -m pytest -q -n 4 tests/test_gpu.py tests/test_gpu_auto.py \
  tests/test_gpu_training.py -p no:cacheprovider -p no:benchmark > $OUT/gpu_tests.log 2>&1
timeout 150 python -m pytest -q -n 4 tests/test_gpu_cuda.py -p no:cacheprovider -p no:benchmark > $OUT/cuda_tests.log 2>&1
timeout 260 python -m convt3d bench --suite kernelbench --json $OUT/bench_kb.json > $OUT/bench_kb.log 2>&1
for f in $OUT/*.log; do echo "== $f"; tail -4 $f; done
