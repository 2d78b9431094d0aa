#!/usr/bin/env bash
# Session 5, GPU call E (final code: the 64-channel K step candidate added): test_gpu, the
# KernelBench evaluator (all eight files), the KernelBench bench table. CUDA build carried in.
export PYTHONPATH=src PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/tex
tar xzf build/tex.tgz -C /tmp && find /tmp/tex \( -name '*.o' -o -name '*.so' \) -exec touch {} +
T0=$(date +%s)
stamp() { echo "$1 done at $(( $(date +%s) - T0 )) s" >> $OUT/times.log; }
timeout 100 python -m pytest -q -n 8 -p no:cacheprovider -p no:benchmark -rfE tests/test_gpu.py \
  > $OUT/gpu_tests.log 2>&1; stamp tests_gpu
timeout 230 python -m convt3d kernelbench --json $OUT/kb_eval.json > $OUT/kb_eval.log 2>&1; stamp kb_eval
timeout 110 python -m convt3d bench --suite kernelbench --json $OUT/bench_kb.json > $OUT/bench_kb.log 2>&1; stamp bench_kb
cat $OUT/times.log; tail -3 $OUT/gpu_tests.log; tail -22 $OUT/kb_eval.log; tail -12 $OUT/bench_kb.log
