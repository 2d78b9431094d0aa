#!/usr/bin/env bash
# The GPU runner: the GPU tests and the bench suites in one call on the GPU machine, logs under one
# folder.
#
# Usage (from the repository root, on the GPU machine):
#   bash tools/gpu_run.sh [LOGDIR] [--only PARTS] [--skip PARTS] [--budget SECONDS]
#                         [--cuda-cache FILE.tgz] [--save-cuda-cache] [--wheels DIR]
#                         [--bench-args "ARGS"] [--pytest-args "ARGS"] [--tests-cap SECONDS]
#
#   LOGDIR        where everything is written (default: $OUT if set, else ./gpu_logs)
#   PARTS         comma-separated, from:
#                   tests     python -m pytest tests/gpu and tests/kernelbench (xdist, -rfE)
#                   kb        convt3d bench --suite kernelbench --json bench_kb.json
#                   layers    convt3d bench --suite layers --json bench_layers.json
#                   networks  convt3d bench --suite networks --json bench_networks.json
#                   tuned     the same with --tune (convt3d.tune and its network check before each
#                             patched first call) -> bench_networks_tuned.json
#                   warm      the networks' first calls again in a new process (--first-calls), with
#                             the caches the parts before it left: a user's warm-cache first call
#                             -> first_calls_warm.json (after networks or tuned)
#                   eval      convt3d kernelbench --json kb_eval.json (the KernelBench evaluator)
#                   full      bench --suite layers --mode full: bf16 cl -> full_bf16_cl.json,
#                             fp32 ncdhw -> full_fp32.json
#                   auto      tools/gpu_auto.py auto.json (auto against each backend)
#                 default: tests,kb,layers,networks,eval
#   --budget      seconds for the whole run (default 570: the device's per-command limit is 600);
#                 each part gets its own cap or what is left, and a part that would start with
#                 less than 30 s left is skipped with a line saying so
#   --cuda-cache  a tarball of a CUDA extension build (TORCH_EXTENSIONS_DIR) to unpack first, so
#                 load_inline builds (the KernelBench CUDA entry) load instead of compiling
#   --save-cuda-cache  write the build as cuda_cache.tgz under LOGDIR at the end
#   --wheels      wheels (optional extras such as monai) to install into /tmp/site, which joins
#                 PYTHONPATH (default: .whl if it exists)
#   --bench-args  extra arguments for every `convt3d bench` call (e.g. "--cudnn-benchmark")
#   --pytest-args extra arguments for pytest (e.g. "-k 'not cuda'")
#   --tests-cap   seconds for the tests part (default 400: the whole GPU suite, CUDA builds included)
#
# Writes under LOGDIR run.log (each part's output under a "==== part" header, with its exit status
# and seconds) and one JSON per bench part (the default parts write 5 files of the 8 the device
# returns), then prints per part its status, seconds and last lines. Exits 1 if any part failed.
#
# One device call, e.g.:  run(command="bash tools/gpu_run.sh --only tests,kb,layers", timeout_s=600)
#
# The other tools of this folder (each one's docstring says what it measures and how to run it):
#   gpu_config_sweep.py     the Triton forward engine's tile configurations, timed one by one
#   gpu_auto.py             "auto" against each backend on both bench suites
#   host_time.py            host time of a call: layers, networks, convt3d's own Python (stubbed)
#   ncu_call.py             one bench row's call under Nsight Compute; a SASS report's hot blocks
#   head_tiles_smem.py      shared memory of every output-head candidate (offline)
#   house_budgets.py        lines, long files, timing figures and private imports of the code
#   bench_md.py             `convt3d bench --json` files as the README's markdown tables
set -u
cd "$(dirname "$0")/.."

LOGDIR="${OUT:-./gpu_logs}"
PARTS="tests,kb,layers,networks,eval"
SKIP=""
BUDGET=570
CUDA_CACHE=""
SAVE_CUDA_CACHE=0
WHEELS=""
BENCH_ARGS=""
PYTEST_ARGS=""
TESTS_CAP=400
[ -d .whl ] && WHEELS=.whl
while [ $# -gt 0 ]; do
  case "$1" in
    --only) PARTS="$2"; shift 2 ;;
    --skip) SKIP="$2"; shift 2 ;;
    --budget) BUDGET="$2"; shift 2 ;;
    --cuda-cache) CUDA_CACHE="$2"; shift 2 ;;
    --save-cuda-cache) SAVE_CUDA_CACHE=1; shift ;;
    --wheels) WHEELS="$2"; shift 2 ;;
    --bench-args) BENCH_ARGS="$2"; shift 2 ;;
    --pytest-args) PYTEST_ARGS="$2"; shift 2 ;;
    --tests-cap) TESTS_CAP="$2"; shift 2 ;;
    -h|--help) sed -n '2,/^set -u/p' "$0" | sed 's/^# \{0,1\}//; /^set -u/d'; exit 0 ;;
    -*) echo "gpu_run.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) LOGDIR="$1"; shift ;;
  esac
done
for p in ${PARTS//,/ } ${SKIP//,/ }; do
  case "$p" in tests|kb|layers|networks|tuned|warm|eval|full|auto) ;;
    *) echo "gpu_run.sh: unknown part '$p' (tests, kb, layers, networks, tuned, warm, eval, full, auto)" >&2
       exit 2 ;;
  esac
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

left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
wanted() { [[ ",$PARTS," == *",$1,"* && ",$SKIP," != *",$1,"* ]]; }

# run_part NAME CAP TAIL COMMAND...: runs COMMAND under timeout min(CAP, time left), its output
# appended to run.log under a header; keeps its exit status (124: cut by its timeout) and its
# last TAIL lines for the summary.
run_part() {
  local name=$1 cap=$2 tl=$3; shift 3
  local l; l=$(left)
  if [ "$l" -lt 30 ]; then
    echo "==== $name: skipped, ${l}s of the ${BUDGET}s budget left" | tee -a "$LOG"
    SUMMARY+=("$name: skipped (budget)"); return
  fi
  local t=$(( cap < l ? cap : l )) s rc part="$TMPD/$name.log"
  s=$(date +%s)
  timeout "$t" "$@" > "$part" 2>&1; rc=$?
  { echo "==== $name (timeout ${t}s): $*"; cat "$part"; echo "==== $name: exit $rc after $(( $(date +%s) - s ))s"; } >> "$LOG"
  SUMMARY+=("$name: exit $rc, $(( $(date +%s) - s ))s")
  [ "$rc" = 0 ] || FAILED=1
  { echo "---- $name (exit $rc), last $tl lines"; tail -n "$tl" "$part" | cut -c1-200; } >> "$TMPD/tails"
}

{
  echo "==== environment"
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv 2>&1
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'triton', triton.__version__)" 2>&1
  git log -1 --format='commit %h %ad %s' --date=short 2>/dev/null || echo "commit: not a git checkout"
  # A copied working tree can carry the git metadata of another commit: the digest of the
  # package's sources says which code ran (compute it at a commit to match).
  python3 -c "from convt3d.bench.report import source_digest; print('source digest', source_digest())" 2>&1
  echo "parts: $PARTS${SKIP:+ (skip $SKIP)}; budget ${BUDGET}s; logs $LOGDIR"
} >> "$LOG"

if [ -n "$WHEELS" ] && ls "$WHEELS"/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl >> "$LOG" 2>&1 && export PYTHONPATH="$PYTHONPATH:/tmp/site"
  echo "wheels from $WHEELS: $(ls "$WHEELS" | tr '\n' ' ')" >> "$LOG"
fi
if [ -n "$CUDA_CACHE" ]; then
  mkdir -p "$TORCH_EXTENSIONS_DIR"
  # The tarball holds the folder itself; touch its objects so ninja sees them as newer than sources.
  tar xzf "$CUDA_CACHE" -C "$(dirname "$TORCH_EXTENSIONS_DIR")" >> "$LOG" 2>&1 \
    && find "$TORCH_EXTENSIONS_DIR" \( -name '*.o' -o -name '*.so' \) -exec touch {} + \
    && echo "cuda cache: unpacked $CUDA_CACHE into $TORCH_EXTENSIONS_DIR" >> "$LOG"
fi

if wanted tests; then
  # shellcheck disable=SC2086
  # Failures (with tracebacks) and tests over 10 s go to tests.log / tests.log.slow as they
  # happen (tests/conftest.py), so a run cut by its cap still says what failed.
  export CONVT3D_TEST_LOG="$LOGDIR/tests.log"
  eval "run_part tests $TESTS_CAP 25 python3 -m pytest -q -n 14 --tb=short -p no:cacheprovider -p no:benchmark -rfE $PYTEST_ARGS tests/gpu tests/kernelbench"
fi
bench() { local name=$1 cap=$2; shift 2
  # shellcheck disable=SC2086
  run_part "$name" "$cap" 16 python3 -m convt3d bench "$@" $BENCH_ARGS; }
wanted kb && bench kb 150 --suite kernelbench --json "$LOGDIR/bench_kb.json"
# The layers suite's first calls compile and tune every row on a cold machine, hence its larger cap.
wanted layers && bench layers 300 --suite layers --json "$LOGDIR/bench_layers.json"
# With cold caches every networks mode compiles and tunes its layers: the part wants a device call of its own.
wanted networks && bench networks 420 --suite networks --json "$LOGDIR/bench_networks.json"
wanted tuned && bench tuned 300 --suite networks --tune --json "$LOGDIR/bench_networks_tuned.json"
wanted warm && bench warm 200 --suite networks --first-calls --json "$LOGDIR/first_calls_warm.json"
wanted eval && run_part eval 240 24 python3 -m convt3d kernelbench --json "$LOGDIR/kb_eval.json"
if wanted full; then
  bench full_bf16_cl 120 --suite layers --mode full --dtype bf16 --layout cl --json "$LOGDIR/full_bf16_cl.json"
  # fp32 NCDHW runs slower per row than bf16 channels-last, hence its larger cap.
  bench full_fp32 150 --suite layers --mode full --dtype fp32 --layout ncdhw --json "$LOGDIR/full_fp32.json"
fi
wanted auto && run_part auto 300 12 python3 tools/gpu_auto.py "$LOGDIR/auto.json"

if [ "$SAVE_CUDA_CACHE" = 1 ] && [ -d "$TORCH_EXTENSIONS_DIR" ]; then
  tar czf "$LOGDIR/cuda_cache.tgz" -C "$(dirname "$TORCH_EXTENSIONS_DIR")" "$(basename "$TORCH_EXTENSIONS_DIR")" \
    && echo "cuda cache: wrote $LOGDIR/cuda_cache.tgz" >> "$LOG"
fi

echo "==== summary (${BUDGET}s budget, $(( $(date +%s) - T0 ))s used; full log: $LOG)"
printf '%s\n' "${SUMMARY[@]}"
cat "$TMPD/tails"
rm -rf "$TMPD"
n=$(find "$LOGDIR" -maxdepth 2 -type f | wc -l)
[ "$n" -gt 8 ] && echo "note: $n files under $LOGDIR; the device returns at most 8 from \$OUT"
exit "$FAILED"
