#!/usr/bin/env bash
# Session 5, GPU call B: GPU tests, then the probe with the new candidates (merged groups for
# KB 72, pre-split tf32x3 for the flat path) and the KernelBench bench table.
export PYTHONPATH=src PYTHONUNBUFFERED=1
T0=$(date +%s)
stamp() { echo "$1 done at $(( $(date +%s) - T0 )) s" >> $OUT/times.log; }
timeout 120 python -m pytest -q -n 8 -p no:cacheprovider -p no:benchmark -rfE tests/test_gpu.py \
  > $OUT/gpu_tests.log 2>&1; stamp tests
timeout 200 python scripts/gpu_precision_probe.py kb72,kb77,kb61,kb73,kb58,kb70,kb68 tf32x3 > $OUT/probe.jsonl 2> $OUT/probe.err; stamp probe
timeout 150 python -m convt3d bench --suite kernelbench --json $OUT/bench_kb.json > $OUT/bench_kb.log 2>&1; stamp bench_kb
tail -3 $OUT/gpu_tests.log; cat $OUT/times.log; tail -3 $OUT/probe.err
python - <<'PY'
import json, os
for l in open(os.environ["OUT"] + "/probe.jsonl"):
    r = json.loads(l); t = r.pop("tuning_ms", None)
    print(r)
    if t: print("   tuning:", t)
PY
tail -30 $OUT/bench_kb.log
