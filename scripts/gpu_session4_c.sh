#!/usr/bin/env bash
# Session 4, GPU call C: build the CUDA engine (new halo variant g64r), time it against g64k32 on
# KB 77; GPU tests of the Triton engine (the plane fill changed) and of the new CUDA variant; the
# KB 77 bench rows (plane fill). Keeps the build for the next calls.
export PYTHONPATH=src PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/tex
T0=$(date +%s)
stamp() { echo "$1 done at $(( $(date +%s) - T0 )) s" >> $OUT/times.log; }
(which ncu nsys; ls /usr/local/cuda/bin | head -40) > $OUT/tools.log 2>&1
timeout 200 python scripts/gpu_cuda.py --problem 77 --rep 60 --variants g64k32,g64r > $OUT/cuda77.log 2>&1; stamp cuda77
(cd /tmp && tar czf $OUT/tex.tgz tex 2>/dev/null); ls -la $OUT/tex.tgz >> $OUT/times.log
timeout 40 python -m convt3d bench --case kb77 --json $OUT/bench_kb77.json > $OUT/bench_kb77.log 2>&1; stamp kb77
timeout 200 python -m pytest -q -n 8 -p no:cacheprovider -p no:benchmark -rfE tests/test_gpu.py tests/test_gpu_cuda.py \
  -k "not (test_gpu_cuda and not (g64r or halo))" > $OUT/gpu_tests.log 2>&1; stamp tests
for f in $OUT/*.log; do echo "== $f"; tail -8 $f; done
