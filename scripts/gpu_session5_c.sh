#!/usr/bin/env bash
# Session 5, GPU call C (merged-group candidates in, pre-split tf32x3 out): training and auto GPU
# tests, the KernelBench evaluator (all eight files), the cuda engine's bench rows, the cuda GPU
# tests, then the layers bench with whatever time is left. The CUDA build is carried in.
export PYTHONPATH=src PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/tex
tar xzf build/tex.tgz -C /tmp && find /tmp/tex \( -name '*.o' -o -name '*.so' \) -exec touch {} +
T0=$(date +%s)
stamp() { echo "$1 done at $(( $(date +%s) - T0 )) s" >> $OUT/times.log; }
left() { echo $(( 575 - ($(date +%s) - T0) )); }
timeout 120 python -m pytest -q -n 8 -p no:cacheprovider -p no:benchmark -rfE tests/test_gpu_training.py \
  tests/test_gpu_auto.py > /tmp/tests_train_auto.log 2>&1; stamp tests_train_auto
timeout 220 python -m convt3d kernelbench --json $OUT/kb_eval.json > /tmp/kb_eval.log 2>&1; stamp kb_eval
timeout 100 python -m convt3d bench --suite kernelbench --backend cuda --precision exact \
  --case kb61,kb68,kb70,kb73,kb77 --json $OUT/bench_cuda.json > /tmp/bench_cuda.log 2>&1; stamp bench_cuda
L=$(left); [ $L -gt 60 ] && timeout $(( L < 130 ? L : 130 )) python -m pytest -q -n 8 -p no:cacheprovider \
  -p no:benchmark -rfE tests/test_gpu_cuda.py > /tmp/tests_cuda.log 2>&1; stamp tests_cuda
L=$(left); [ $L -gt 40 ] && timeout $L python -m convt3d bench --suite layers --json $OUT/bench_layers.json \
  > /tmp/bench_layers.log 2>&1; stamp bench_layers
for f in /tmp/tests_train_auto.log /tmp/kb_eval.log /tmp/bench_cuda.log /tmp/tests_cuda.log /tmp/bench_layers.log; do
  echo "== $f"; tail -4 $f; done > $OUT/tails.log
cat /tmp/kb_eval.log > $OUT/kb_eval.log
cat $OUT/times.log $OUT/tails.log
