#!/usr/bin/env bash
# The GPU runner: the GPU tests, the bench suites and the KernelBench evaluator in one call on the
# GPU machine, with every log under one folder.
#
# Usage (from the repository root, on the GPU machine; --help prints this header):
#   bash tools/gpu_run.sh [LOGDIR] [--only PARTS] [--skip PARTS] [--pytest-args "ARGS"] [--tests-cap SECONDS]
#
#   LOGDIR        where everything is written (default: $OUT if set, else ./gpu_logs)
#   PARTS         comma-separated (default tests,kb,layers,networks,eval), from:
#                   tests     pytest tests/gpu (14 workers), then tests/kernelbench (3) (-rfE; cap --tests-cap each, default 400 s)
#                   kb, layers, networks   convt3d bench on that suite -> bench_PART.json
#                   tuned     networks with --tune -> bench_networks_tuned.json
#                   warm      networks --first-calls in a new process, after the parts before it
#                             filled the caches -> first_calls_warm.json
#                   eval      convt3d kernelbench (the KernelBench evaluator) -> kb_eval.json
#                   fuzz      tools/error_fuzz.py, 150 seeded random layers' errors -> error_fuzz.json
#                   harness   tools/kb_harness.py, KernelBench's own harness on the level-1 and level-2 files
#                             -> kb_harness_l1.json, kb_harness_l2.json (needs a KernelBench checkout in
#                             $KB_SRC, default .kb, carried: "carry": [".kb"])
#                   first     tools/first_call.py, cold and warm first calls of the layers-suite rows
#                             -> first_call_bg.json
#                   full      layers --mode full: bf16 cl -> full_bf16_cl.json, fp32 ncdhw -> full_fp32.json
#   --pytest-args extra arguments for pytest (e.g. "-k 'not cuda'")
#
# The run keeps within 570 s (the device's per-command limit): each part runs under its own cap or the
# time left, and one with less than 30 s left is skipped. Wheels under .whl (optional extras such as
# monai) go into /tmp/site first. Writes LOGDIR/run.log (each part's output, exit status and seconds)
# and each part's JSON, then prints each part's status and last lines. Exits 1 if any part failed.
#   run(command="bash tools/gpu_run.sh --only tests,kb,layers", timeout_s=600)
set -u
cd "$(dirname "$0")/.."

LOGDIR="${OUT:-./gpu_logs}"
PARTS="tests,kb,layers,networks,eval"
SKIP=""
PYTEST_ARGS=""
TESTS_CAP=400
BUDGET=570
while [ $# -gt 0 ]; do
  case "$1" in
    --only) PARTS="$2"; shift 2 ;;
    --skip) SKIP="$2"; shift 2 ;;
    --pytest-args) PYTEST_ARGS="$2"; shift 2 ;;
    --tests-cap) TESTS_CAP="$2"; shift 2 ;;
    -h|--help) sed -n '2,/^set -u/p' "$0" | sed 's/^# \{0,1\}//; /^set -u/d'; exit 0 ;;
    -*) echo "gpu_run.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) LOGDIR="$1"; shift ;;
  esac
done
ALL_PARTS="tests kb layers networks tuned warm eval full fuzz harness first"
for p in ${PARTS//,/ } ${SKIP//,/ }; do
  [[ " $ALL_PARTS " == *" $p "* ]] || { echo "gpu_run.sh: unknown part '$p' ($ALL_PARTS)" >&2; exit 2; }
done

mkdir -p "$LOGDIR"
LOG="$LOGDIR/run.log"
: > "$LOG"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/tex}"
T0=$(date +%s)
SUMMARY=()
FAILED=0
TMPD=$(mktemp -d)
: > "$TMPD/tails"

wanted() { [[ ",$PARTS," == *",$1,"* && ",$SKIP," != *",$1,"* ]]; }

# run_part NAME CAP TAIL COMMAND...: COMMAND under timeout min(CAP, time left), its output appended
# to run.log; its exit status (124: cut by its timeout) and last TAIL lines go to the summary.
run_part() {
  local name=$1 cap=$2 tl=$3
  shift 3
  local left=$(( BUDGET - ($(date +%s) - T0) ))
  if [ "$left" -lt 30 ]; then
    echo "==== $name: skipped, ${left}s of the ${BUDGET}s budget left" | tee -a "$LOG"
    SUMMARY+=("$name: skipped (budget)")
    return
  fi
  local t=$(( cap < left ? cap : left )) s=$(date +%s) rc part="$TMPD/$name.log"
  timeout "$t" "$@" > "$part" 2>&1
  rc=$?
  { echo "==== $name (timeout ${t}s): $*"; cat "$part"; echo "==== $name: exit $rc after $(( $(date +%s) - s ))s"; } >> "$LOG"
  SUMMARY+=("$name: exit $rc, $(( $(date +%s) - s ))s")
  [ "$rc" = 0 ] || FAILED=1
  { echo "---- $name (exit $rc), last $tl lines"; tail -n "$tl" "$part" | cut -c1-200; } >> "$TMPD/tails"
}

bench() { run_part "$1" "$2" 16 python3 -m convt3d bench "${@:3}"; }  # bench NAME CAP ARGS...

{
  echo "==== environment"
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv 2>&1
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'triton', triton.__version__)" 2>&1
  git log -1 --format='commit %h %ad %s' --date=short 2>/dev/null || echo "commit: not a git checkout"
  # The sources' digest says which code ran, whatever git metadata a copied tree carries.
  python3 -c "from convt3d.bench.report import source_digest; print('source digest', source_digest())" 2>&1
  echo "parts: $PARTS${SKIP:+ (skip $SKIP)}; budget ${BUDGET}s; logs $LOGDIR"
} >> "$LOG"

if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl >> "$LOG" 2>&1 && export PYTHONPATH="$PYTHONPATH:/tmp/site"
  echo "wheels from .whl: $(ls .whl | tr '\n' ' ')" >> "$LOG"
fi

if wanted tests; then
  # Failures and tests over 10 s go to tests.log(.slow) as they happen (tests/conftest.py): a cut run says what failed.
  export CONVT3D_TEST_LOG="$LOGDIR/tests.log"
  # KernelBench's problems hold up to tens of GB each: their files run on 3 workers, after the rest.
  eval "run_part tests $TESTS_CAP 25 python3 -m pytest -q -n 14 --tb=short -p no:cacheprovider -p no:benchmark -rfE $PYTEST_ARGS tests/gpu"
  eval "run_part tests-kernelbench $TESTS_CAP 25 python3 -m pytest -q -n 3 --tb=short -p no:cacheprovider -p no:benchmark -rfE $PYTEST_ARGS tests/kernelbench"
fi
wanted kb && bench kb 150 --suite kernelbench --json "$LOGDIR/bench_kb.json"
# The layers suite's first calls compile and tune every row on a cold machine, hence its larger cap.
wanted layers && bench layers 300 --suite layers --json "$LOGDIR/bench_layers.json"
# With cold caches every networks mode compiles and tunes its layers: the part wants a device call of its own.
wanted networks && bench networks 420 --suite networks --json "$LOGDIR/bench_networks.json"
wanted tuned && bench tuned 300 --suite networks --tune --json "$LOGDIR/bench_networks_tuned.json"
wanted warm && bench warm 200 --suite networks --first-calls --json "$LOGDIR/first_calls_warm.json"
wanted eval && run_part eval 240 24 python3 -m convt3d kernelbench --json "$LOGDIR/kb_eval.json"
# Each drawn layer is a first call (compile and tune): no layer starts after 480 s.
wanted fuzz && run_part fuzz 540 24 python3 tools/error_fuzz.py --count 150 --deadline 480 --json "$LOGDIR/error_fuzz.json"
if wanted harness; then
  KB_SRC="${KB_SRC:-.kb}"
  if [ -d "$KB_SRC/src/kernelbench" ]; then
    run_part harness-l1 200 12 python3 tools/kb_harness.py --kb "$KB_SRC" --level 1 --budget 150 --json "$LOGDIR/kb_harness_l1.json"
    run_part harness-l2 300 24 python3 tools/kb_harness.py --kb "$KB_SRC" --level 2 --budget 240 --json "$LOGDIR/kb_harness_l2.json"
  else
    echo "==== harness: skipped, no KernelBench checkout at $KB_SRC" | tee -a "$LOG"; SUMMARY+=("harness: skipped (no $KB_SRC)")
  fi
fi
wanted first && OUT="$LOGDIR" run_part first 420 24 python3 tools/first_call.py
if wanted full; then
  bench full_bf16_cl 120 --suite layers --mode full --dtype bf16 --layout cl --json "$LOGDIR/full_bf16_cl.json"
  # fp32 NCDHW runs slower per row than bf16 channels-last, hence its larger cap.
  bench full_fp32 150 --suite layers --mode full --dtype fp32 --layout ncdhw --json "$LOGDIR/full_fp32.json"
fi

echo "==== summary (${BUDGET}s budget, $(( $(date +%s) - T0 ))s used; full log: $LOG)"
printf '%s\n' "${SUMMARY[@]}"
cat "$TMPD/tails"
rm -rf "$TMPD"
n=$(find "$LOGDIR" -maxdepth 2 -type f | wc -l)
[ "$n" -gt 8 ] && echo "note: $n files under $LOGDIR; the device returns at most 8 from \$OUT"
exit "$FAILED"
