#!/usr/bin/env bash
# Session 3, GPU call D: the new CUDA gemm kernel on KB 77 (build + variants), GPU tests of the
# CUDA engine, the Triton dX kernel and the engine; backward parts per layer; keep the build.
export PYTHONPATH=src PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/tex
T0=$(date +%s)
timeout 270 python scripts/gpu_cuda.py --problem 77 --rep 60 > $OUT/cuda77.log 2>&1
echo "cuda77 done at $(( $(date +%s) - T0 )) s" >> $OUT/times.log
(cd /tmp && tar czf $OUT/tex.tgz tex 2>/dev/null); ls -la $OUT/tex.tgz >> $OUT/times.log
timeout 150 python -m pytest -q -n 6 -p no:cacheprovider -p no:benchmark tests/test_gpu_cuda.py tests/test_gpu.py \
  > $OUT/gpu_tests_a.log 2>&1
echo "tests a done at $(( $(date +%s) - T0 )) s" >> $OUT/times.log
timeout 110 python -m pytest -q -n 6 -p no:cacheprovider -p no:benchmark tests/test_gpu_training.py \
  > $OUT/gpu_tests_b.log 2>&1
echo "tests b done at $(( $(date +%s) - T0 )) s" >> $OUT/times.log
timeout $(( 560 - ($(date +%s) - T0) )) python scripts/gpu_training.py --json $OUT/gpu_training.json > $OUT/training.log 2>&1
echo "training done at $(( $(date +%s) - T0 )) s" >> $OUT/times.log
for f in $OUT/*.log; do echo "== $f"; tail -4 $f; done
