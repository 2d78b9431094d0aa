#!/usr/bin/env bash
# Session 5, GPU call D (final code): test_gpu (with the every-candidate test of grouped calls),
# the KernelBench bench table, then the training and auto GPU tests.
export PYTHONPATH=src PYTHONUNBUFFERED=1
T0=$(date +%s)
stamp() { echo "$1 done at $(( $(date +%s) - T0 )) s" >> $OUT/times.log; }
timeout 150 python -m pytest -q -n 8 -p no:cacheprovider -p no:benchmark -rfE tests/test_gpu.py \
  > $OUT/gpu_tests.log 2>&1; stamp tests_gpu
timeout 120 python -m convt3d bench --suite kernelbench --json $OUT/bench_kb.json > $OUT/bench_kb.log 2>&1; stamp bench_kb
timeout 280 python -m pytest -q -n 8 -p no:cacheprovider -p no:benchmark -rfE --durations=10 \
  tests/test_gpu_training.py tests/test_gpu_auto.py > $OUT/gpu_tests_train_auto.log 2>&1; stamp tests_train_auto
cat $OUT/times.log
for f in $OUT/gpu_tests.log $OUT/gpu_tests_train_auto.log; do echo "== $f"; tail -15 $f; done
tail -12 $OUT/bench_kb.log
