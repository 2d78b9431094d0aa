#!/usr/bin/env bash
# Session 4, GPU call A: the whole GPU test suite on the session-3 code, the KernelBench evaluator,
# and a probe of cuDNN's forward conv3d against conv_transpose3d on the stride-1 problems.
export PYTHONPATH=src PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/tex
tar xzf build/tex.tgz -C /tmp && find /tmp/tex \( -name '*.o' -o -name '*.so' \) -exec touch {} +
T0=$(date +%s)
stamp() { echo "$1 done at $(( $(date +%s) - T0 )) s" >> $OUT/times.log; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > $OUT/smi.log 2>&1
timeout 90 python scripts/gpu_fprop_probe.py > $OUT/fprop.log 2>&1; stamp fprop
timeout 130 python -m pytest -q -n 8 -p no:cacheprovider -p no:benchmark -rfE tests/test_gpu_cuda.py tests/test_gpu.py \
  > $OUT/gpu_tests_a.log 2>&1; stamp tests_a
timeout 200 python -m pytest -q -n 8 -p no:cacheprovider -p no:benchmark -rfE --durations=15 tests/test_gpu_training.py \
  tests/test_gpu_auto.py > $OUT/gpu_tests_b.log 2>&1; stamp tests_b
timeout $(( 560 - ($(date +%s) - T0) )) python -m convt3d kernelbench --json $OUT/kb_eval.json > $OUT/kb_eval.log 2>&1; stamp kb_eval
for f in $OUT/*.log; do echo "== $f"; tail -6 $f; done
