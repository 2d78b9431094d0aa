#!/usr/bin/env bash
# Session 3, GPU call E1: GPU tests of training/auto; --mode full tables (benchmark off); auto vs
# every backend on both suites (scripts/gpu_auto.py). The CUDA build of call D is carried in.
export PYTHONPATH=src PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/tex
tar xzf build/tex.tgz -C /tmp && find /tmp/tex \( -name '*.o' -o -name '*.so' \) -exec touch {} +
T0=$(date +%s)
left() { echo $(( 570 - ($(date +%s) - T0) )); }
timeout 130 python -m pytest -q -n 6 -p no:cacheprovider -p no:benchmark tests/test_gpu_training.py \
  tests/test_gpu_auto.py > $OUT/gpu_tests.log 2>&1
echo "tests done at $(( $(date +%s) - T0 )) s" >> $OUT/times.log
timeout 110 python -m convt3d bench --suite layers --mode full --dtype bf16 --layout cl \
  --json $OUT/full_bf16_cl.json > $OUT/full_bf16_cl.log 2>&1
timeout 110 python -m convt3d bench --suite layers --mode full --dtype fp32 --layout ncdhw \
  --json $OUT/full_fp32.json > $OUT/full_fp32.log 2>&1
echo "full done at $(( $(date +%s) - T0 )) s" >> $OUT/times.log
timeout $(left) python scripts/gpu_auto.py $OUT/auto.json > $OUT/auto.log 2>&1
echo "auto done at $(( $(date +%s) - T0 )) s" >> $OUT/times.log
for f in $OUT/*.log; do echo "== $f"; tail -5 $f; done
