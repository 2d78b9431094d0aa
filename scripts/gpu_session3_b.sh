#!/usr/bin/env bash
# Session 3, GPU call B: host time after launch sites + eager autograd; GPU tests; training parts.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 120 python scripts/gpu_hostprof.py > $OUT/hostprof.log 2>&1
timeout 300 python -m pytest -q -n 4 -p no:cacheprovider -p no:benchmark tests/test_gpu.py tests/test_gpu_training.py \
  tests/test_gpu_auto.py > $OUT/gpu_tests.log 2>&1
CONVT3D_BWD_INPUT=cudnn timeout 200 python scripts/gpu_training.py --json $OUT/gpu_training.json > $OUT/training.log 2>&1
for f in $OUT/*.log; do echo "== $f"; tail -4 $f; done
grep -E "us/call|launch|TensorDesc" $OUT/hostprof.log
