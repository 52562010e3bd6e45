#!/usr/bin/env bash
# The device check: one prepared script for a GPU machine with no internet, in under 8 minutes.
#
#   bash bench/device_check.sh [--out DIR] [--work DIR] [--budget-s 470] [--cpu-tiny] [--python python3]
#   (--cpu-tiny: phase caps x3 and a 1200 s budget by default, for shared CI CPUs)
#
# Writes to --out (default $OUT, else bench/results/device-check-<time>), at most 8 files, none deeper:
#   env.json    torch, CUDA/ROCm, device, driver, which kernels and packages import
#   probe.json  the memory plan against the saved-tensor probe at gpu-smoke's shape (bench/memory_probe.py)
#   bench.json  the gpu_bench.py ladder: plain -> liger -> chunked loss -> regional compile -> gpu-smoke's
#               settings -> micro-batch sweep of the best -> whole-model compile and the rest
#   run.json, train.jsonl   the runner's own gpu-smoke run: launched, SIGKILLed in step 23, resumed
#   table.md    one screen of markdown for docs/GPU_BENCH.md (bench/device_table.py)
#   log.txt     everything every phase printed
# Phases, in order (each under its own time cap and the global budget; one that fails is a line in the
# table, never the end of the check): env, carried wheels, built-in corpus, pytest -m gpu, memory probe,
# launch + SIGKILL, resume, runner audit, bench ladder (takes the time left), table.
#
# The device has torch, transformers, accelerate, huggingface_hub, nvidia-ml-py but not omegaconf,
# pandera or liger-kernel: they travel as wheels in bench/wheels/ (bench/fetch_device_wheels.sh, run
# where pip can reach an index) and are installed into the work folder when this Python lacks them.
# mlflow does not travel (its wheels and dependencies are over the carry limit): the runner runs with
# --no-tracking here, and system metrics go to the run folder and run.json as always.
# --cpu-tiny runs the same phases on a CPU with gpu-smoke's stand-in (experiments/gpu-smoke-cpu.yaml);
# CI runs it (tests/test_device_check.py).
set -u -o pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT_DIR=${OUT:-}
WORK=""
BUDGET_S=""
CPU_TINY=0
PY=${PYTHON:-python3}
COMMAND="bash bench/device_check.sh $*"
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT_DIR=$2; shift 2 ;;
    --work) WORK=$2; shift 2 ;;
    --budget-s) BUDGET_S=$2; shift 2 ;;
    --cpu-tiny) CPU_TINY=1; shift ;;
    --python) PY=$2; shift 2 ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "device_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
cd "$ROOT" || exit 2
OUT_DIR=${OUT_DIR:-$ROOT/bench/results/device-check-$(date +%Y%m%d-%H%M%S)}
WORK=${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/device-check.XXXXXX")}
mkdir -p "$OUT_DIR" "$WORK" || exit 2
LOG=$OUT_DIR/log.txt
PHASES=$WORK/phases.jsonl
: > "$LOG"
: > "$PHASES"
if [ "$CPU_TINY" = 1 ]; then
  # CI's CPUs are shared and slow: the same phases with caps three times as long
  SCALE=3; BUDGET_S=${BUDGET_S:-1200}
else
  SCALE=1; BUDGET_S=${BUDGET_S:-470}
fi
T0=$(date +%s)
DEADLINE=$((T0 + BUDGET_S))
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

if [ "$CPU_TINY" = 1 ]; then
  SMOKE=experiments/gpu-smoke-cpu.yaml; PROBE_MICRO=1,8; BENCH_FLAGS=(--cpu-tiny --variant-s 15)
else
  SMOKE=experiments/gpu-smoke.yaml; PROBE_MICRO=1,2; BENCH_FLAGS=(--variant-s 20 --steps 8 --warmup-steps 2)
fi
KILL_AT=23   # gpu-smoke checkpoints at step 20: the resume redoes steps 21-23
RUN_DIR=$WORK/run
printf '{"experiment": "%s", "kill_at_step": %s, "cpu_tiny": %s}\n' "$SMOKE" "$KILL_AT" "$CPU_TINY" > "$WORK/check.json"

say() { echo "== device_check: $*" | tee -a "$LOG"; }

# phase NAME CAP_SECONDS EXPECTED_RCS CMD...: run CMD under min(CAP, time left), log it, record it.
phase() {
  local name=$1 cap=$2 expected=$3; shift 3
  local left=$((DEADLINE - $(date +%s)))
  cap=$((cap * SCALE))
  local limit=$(( cap < left ? cap : left ))
  if [ "$limit" -lt 5 ]; then
    say "$name: skipped, budget spent"
    printf '{"phase": "%s", "rc": null, "seconds": 0, "expected": [%s], "note": "budget spent"}\n' "$name" "$expected" >> "$PHASES"
    return 0
  fi
  say "$name (up to ${limit} s): $*"
  local start rc
  start=$(date +%s)
  timeout --kill-after=20 "$limit" "$@" >> "$LOG" 2>&1
  rc=$?
  say "$name: exit $rc after $(( $(date +%s) - start )) s"
  printf '{"phase": "%s", "rc": %s, "seconds": %s, "expected": [%s]}\n' "$name" "$rc" "$(( $(date +%s) - start ))" "$expected" >> "$PHASES"
  return 0
}

# The carried wheels, only where this Python lacks what the runner needs (the device, not CI).
SITE=$WORK/site
if ! "$PY" -c "import omegaconf, pandera" >/dev/null 2>&1; then
  if ls bench/wheels/*.whl >/dev/null 2>&1; then
    phase wheels 60 0 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" bench/wheels/*.whl
  else
    say "wheels: this Python lacks omegaconf/pandera and bench/wheels/ is empty: run bench/fetch_device_wheels.sh first"
  fi
fi
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"

phase env 60 0 "$PY" bench/device_table.py env --out "$OUT_DIR/env.json"
phase corpus 60 0 "$PY" -m runner data builtin
# pytest's exit 5 = nothing collected to run: every test skipped for want of a GPU (--cpu-tiny)
phase pytest-gpu 90 0,5 bash -c "set -o pipefail; '$PY' -m pytest -m gpu tests/test_gpu.py -p no:cacheprovider -rfEs 2>&1 | tee '$WORK/pytest.txt'"
phase memory-probe 60 0 "$PY" bench/memory_probe.py --experiment "$SMOKE" --micro-batches "$PROBE_MICRO" \
  --out "$OUT_DIR/probe.json"
rm -rf "$RUN_DIR"
# --kill-at-step: the runner SIGKILLs itself in that step (after its first micro batch): exit 137
phase launch-killed 170 137 "$PY" -m runner launch "$SMOKE" --run-dir "$RUN_DIR" --no-tracking --kill-at-step "$KILL_AT"
phase resume 180 0 "$PY" -m runner launch "$RUN_DIR" --no-tracking
phase audit 45 "0, 5" "$PY" -m runner audit "$RUN_DIR"
cp "$RUN_DIR/run.json" "$OUT_DIR/run.json" 2>/dev/null
cp "$RUN_DIR/metrics/train.jsonl" "$OUT_DIR/train.jsonl" 2>/dev/null
LEFT=$((DEADLINE - $(date +%s) - 25))
if [ "$LEFT" -ge 30 ]; then
  phase bench $((LEFT + 15)) 0 "$PY" bench/gpu_bench.py "${BENCH_FLAGS[@]}" --budget-s "$LEFT" \
    --smoke-experiment "$SMOKE" --out "$OUT_DIR/bench.json"
else
  say "bench: skipped, ${LEFT} s left"
  printf '{"phase": "bench", "rc": null, "seconds": 0, "expected": [0], "note": "budget spent"}\n' >> "$PHASES"
fi
"$PY" bench/device_table.py table --out "$OUT_DIR" --work "$WORK" --command "$COMMAND" 2>>"$LOG" | tee -a "$LOG"
say "done in $(( $(date +%s) - T0 )) s; results in $OUT_DIR, work (run folder, checkpoints) in $WORK"
