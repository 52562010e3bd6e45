#!/usr/bin/env bash
# The device check: one prepared script for a GPU machine with no internet, in under 8 minutes.
#
#   bash bench/device_check.sh [--out DIR] [--work DIR] [--budget-s 560] [--cpu-tiny] [--python python3]
#        [--call 1|2] [--only PHASE,PHASE] [--cap PHASE=SECONDS ...] [--bench-args "..."]
#   (--call 1: what decides, in one call of at most 9.5 minutes: env, the launch's import profile, the decisive bench rows (1p3b's
#   recipe, gpu-smoke's settings), the MoE rows, the corpus, gpu-smoke launched, SIGKILLed, resumed and
#   audited (its startup parts and checkpoint stall in the table); --call 2, the same --out: pytest -m
#   gpu, the memory probe and the rest of the ladder, appended to bench.json. Without --call: all.)
#   (--cpu-tiny: phase caps x3 and a 1200 s budget by default, for shared CI CPUs; --only runs those
#   phases alone, --cap sets one phase's cap (not scaled), --bench-args adds gpu_bench.py flags:
#   what tests/e2e/test_device_check.py uses to prove the caps cheaply)
#
# Writes to --out (default $OUT, else bench/results/device-check-<time>), at most 8 files, none deeper:
#   env.json    torch, CUDA/ROCm, device, driver, which kernels and packages import; where the launch's
#               import seconds go (`imports`: -X importtime summed by package, CUDA's first use)
#   probe.json  the memory plan against the saved-tensor probe at gpu-smoke's shape (bench/memory_probe.py)
#   bench.json  gpu_bench.py, written row by row: first the matmul ceiling and the decisive rows (1p3b's
#               own settings, with and without Liger), then the ladder: plain -> liger -> chunked loss ->
#               regional compile -> gpu-smoke's settings -> micro-batch sweep -> whole-model compile, ...
#   run.json, train.jsonl   the runner's own gpu-smoke run: launched, SIGKILLed in step 8, resumed
#   table.md    one screen of markdown for docs/GPU_BENCH.md (bench/device_table.py), budget table first
#   log.txt     the budget table, then everything every phase printed
# Phases, in order (each under its own cap and the global budget; one that fails or is killed at its cap
# is a line in the table, never the end of the check; the budget table at the start lists the caps):
# carried wheels, env, imports, bench-decisive, built-in corpus, pytest -m gpu (2 workers), memory probe,
# launch + SIGKILL, resume, runner audit, bench-rest (takes the time left), table.
#
# The device has torch, transformers, accelerate, huggingface_hub, nvidia-ml-py but not omegaconf,
# pandera or liger-kernel: they travel as wheels in bench/wheels/ (bench/fetch_device_wheels.sh, run
# where pip can reach an index) and are installed into the work folder when this Python lacks them.
# mlflow does not travel (its wheels and dependencies are over the carry limit): the runner runs with
# --no-tracking here, and system metrics go to the run folder and run.json as always.
# --cpu-tiny runs the same phases on a CPU with gpu-smoke's stand-in (experiments/gpu-smoke-cpu.yaml);
# CI runs it (tests/e2e/test_device_check.py).
set -u -o pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT_DIR=${OUT:-}
WORK=""
BUDGET_S=""
CPU_TINY=0
PY=${PYTHON:-python3}
ONLY=""
BENCH_ARGS=""
declare -A CAP_SET=()
COMMAND="bash bench/device_check.sh $*"
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT_DIR=$2; shift 2 ;;
    --work) WORK=$2; shift 2 ;;
    --budget-s) BUDGET_S=$2; shift 2 ;;
    --cpu-tiny) CPU_TINY=1; shift ;;
    --python) PY=$2; shift 2 ;;
    --only) ONLY=",$2,"; shift 2 ;;
    --call) case "$2" in
        1) ONLY=",wheels,env,imports,bench-decisive,bench-moe,corpus,launch-killed,resume,audit," ;;
        2) ONLY=",wheels,env,pytest-gpu,memory-probe,bench-rest," ;;
        *) echo "device_check.sh: --call 1 or 2" >&2; exit 2 ;;
      esac; shift 2 ;;
    --cap) CAP_SET[${2%%=*}]=${2#*=}; shift 2 ;;
    --bench-args) BENCH_ARGS=$2; shift 2 ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
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
  SCALE=1; BUDGET_S=${BUDGET_S:-560}
fi
T0=$(date +%s)
DEADLINE=$((T0 + BUDGET_S))
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

if [ "$CPU_TINY" = 1 ]; then
  SMOKE=experiments/gpu-smoke-cpu.yaml; PROBE_MICRO=1,8; BENCH_FLAGS=(--cpu-tiny --variant-s 15)
  MOE=experiments/cpu-tiny-moe.yaml
else
  # --variant-s 30: the 1p3b recipe's build + whole-model compile + warm-up took 76.8 s on the H200
  # (its box is 4 x 30 = 120 s); gpu-smoke's regional compile gets 3 x 30
  SMOKE=experiments/gpu-smoke.yaml; PROBE_MICRO=1,2; BENCH_FLAGS=(--variant-s 30 --steps 8 --warmup-steps 2)
  MOE=experiments/olmoe-1b-7b.yaml
fi
# shellcheck disable=SC2206
BENCH_FLAGS+=($BENCH_ARGS)
KILL_AT=8   # gpu-smoke checkpoints at step 6: the resume redoes steps 7-8, then runs to 16

# Each phase's cap in seconds on a GPU (x SCALE on --cpu-tiny; --cap overrides), in the order they run.
# bench-rest has none: it takes what the others leave. Caps are bounds, not estimates.
# The caps, from the H200's measured phases (2026-12-04: env 18 s, bench-decisive 118, corpus 3, pytest-gpu 48,
# memory-probe 21, launch-killed 88, resume 104-110, audit ~28) with margin; bench-decisive now holds the
# 1p3b recipe (76.8 s to build, compile, warm up) and gpu-smoke's settings row (regional compile).
PHASE_ORDER=(wheels env imports bench-decisive bench-moe corpus launch-killed resume audit pytest-gpu memory-probe bench-rest)
declare -A CAP=([wheels]=30 [env]=25 [imports]=75 [bench-decisive]=220 [bench-moe]=70 [corpus]=15 [pytest-gpu]=60
  [memory-probe]=30 [launch-killed]=100 [resume]=140 [audit]=45)
declare -A WHAT=([wheels]="omegaconf, pandera, liger-kernel from bench/wheels (only when missing)"
  [env]="torch, CUDA/ROCm, device, driver, kernels that import"
  [imports]="where the launch's import seconds go: -X importtime by package, CUDA's first use, bytecode, memory, a second process, the runner's bytecode cache (into env.json)"
  [bench-decisive]="matmul ceiling; the 1p3b recipe (whole-model compile, plain loss, bf16); gpu-smoke's settings row"
  [bench-moe]="gpu_bench.py --part moe on $MOE (where gpu_bench.py has it)"
  [corpus]="runner data builtin" [pytest-gpu]="pytest -m gpu tests/training/test_gpu.py, 2 workers (1 without pytest-xdist)"
  [memory-probe]="memory plan vs saved-tensor probe at gpu-smoke's shape"
  [launch-killed]="runner launch gpu-smoke, SIGKILLed in step $KILL_AT (checkpoint at 6)"
  [resume]="resume to step 16, one evaluation at the end" [audit]="runner audit of that run"
  [bench-rest]="the ladder after the decisive rows, appended to bench.json")
for name in "${!CAP[@]}"; do CAP[$name]=$((CAP[$name] * SCALE)); done
for name in "${!CAP_SET[@]}"; do CAP[$name]=${CAP_SET[$name]}; done
selected() { [ -z "$ONLY" ] || [[ "$ONLY" == *",$1,"* ]]; }
RUN_DIR=$WORK/run
printf '{"experiment": "%s", "kill_at_step": %s, "cpu_tiny": %s}\n' "$SMOKE" "$KILL_AT" "$CPU_TINY" > "$WORK/check.json"

say() { echo "== device_check: $*" | tee -a "$LOG"; }

# The budget table, first in the log and (budget.md) in table.md: each phase's cap, the bench's share.
{
  fixed=0
  echo "Budget: ${BUDGET_S} s in all (phase caps x${SCALE}); a phase ends when its command does, or at its cap"
  echo "(timeout: TERM, KILL 20 s later), or when the budget is spent."
  echo ""
  echo "| # | phase | cap s | runs |"
  echo "|---|---|---|---|"
  i=0
  for name in "${PHASE_ORDER[@]}"; do
    selected "$name" || continue
    i=$((i + 1))
    if [ "$name" = bench-rest ]; then cap=${CAP_SET[bench-rest]:-the rest}; else cap=${CAP[$name]}; fixed=$((fixed + cap)); fi
    echo "| $i | $name | $cap | ${WHAT[$name]} |"
  done
  echo ""
  echo "Bench's share: bench-decisive's ${CAP[bench-decisive]} s first; bench-rest what the others leave:"\
    "$((BUDGET_S - fixed > 0 ? BUDGET_S - fixed : 0)) s if every phase ran to its cap (the caps add up to"\
    "${fixed} s of ${BUDGET_S}: the budget cuts the last phases first), more as they end sooner."
} > "$WORK/budget.md"
tee -a "$LOG" < "$WORK/budget.md"

# phase NAME EXPECTED_RCS CMD...: run CMD under min(its cap, time left), log it, record it.
phase() {
  local name=$1 expected=$2; shift 2
  selected "$name" || return 0
  local left=$((DEADLINE - $(date +%s)))
  local cap=${CAP[$name]}
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
  local took=$(( $(date +%s) - start ))
  local note=""
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && [ "$took" -ge "$limit" ] && note=", \"note\": \"killed at its cap\""
  say "$name: exit $rc after $took s"
  printf '{"phase": "%s", "rc": %s, "seconds": %s, "cap": %s, "expected": [%s]%s}\n' "$name" "$rc" "$took" "$limit" "$expected" "$note" >> "$PHASES"
  return 0
}

# The carried wheels, only where this Python lacks what the runner needs (the device, not CI).
SITE=$WORK/site
if ! "$PY" -c "import omegaconf, pandera" >/dev/null 2>&1; then
  if ls bench/wheels/*.whl >/dev/null 2>&1; then
    phase wheels 0 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" bench/wheels/*.whl
  else
    say "wheels: this Python lacks omegaconf/pandera and bench/wheels/ is empty: run bench/fetch_device_wheels.sh first"
  fi
fi
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"

phase env 0 "$PY" bench/device_table.py env --out "$OUT_DIR/env.json"
# run.json's t_startup.imports was 13.2-13.7 s on the H200 against 3.4 s on a CPU: which packages take it,
# and whether every process compiles them from source (no bytecode beside them, none written): then the
# same imports with the runner's bytecode cache, filling it and reading it (a fresh temporary folder)
phase imports 0 "$PY" bench/device_table.py imports --out "$OUT_DIR/env.json"
# what decides first: the ceiling and 1p3b's own settings with and without Liger (bench.json row by row)
phase bench-decisive 0 "$PY" bench/gpu_bench.py "${BENCH_FLAGS[@]}" --part decisive \
  --budget-s "$(( ${CAP[bench-decisive]} > 20 ? ${CAP[bench-decisive]} - 10 : ${CAP[bench-decisive]} ))" \
  --smoke-experiment "$SMOKE" --out "$OUT_DIR/bench.json"
# the mixture-of-experts rows (the `moe` helper's `--part moe`); a gpu_bench.py without it is a line, not a failure
if grep -q '"moe"' bench/gpu_bench.py; then
  phase bench-moe 0 "$PY" bench/gpu_bench.py "${BENCH_FLAGS[@]}" --part moe --experiment "$MOE" \
    --budget-s "$(( ${CAP[bench-moe]} > 20 ? ${CAP[bench-moe]} - 10 : ${CAP[bench-moe]} ))" --out "$OUT_DIR/bench-moe.json"
elif selected bench-moe; then
  say "bench-moe: skipped, gpu_bench.py has no --part moe"
  printf '{"phase": "bench-moe", "rc": null, "seconds": 0, "expected": [null], "note": "gpu_bench.py has no --part moe"}\n' >> "$PHASES"
fi
phase corpus 0 "$PY" -m runner data builtin
if selected launch-killed; then rm -rf "$RUN_DIR"; fi
# --kill-at-step: the runner SIGKILLs itself in that step (after its first micro batch): exit 137
phase launch-killed 137 "$PY" -m runner launch "$SMOKE" --run-dir "$RUN_DIR" --no-tracking --kill-at-step "$KILL_AT"
phase resume 0 "$PY" -m runner launch "$RUN_DIR" --no-tracking
phase audit "0, 5" "$PY" -m runner audit "$RUN_DIR"
cp "$RUN_DIR/run.json" "$OUT_DIR/run.json" 2>/dev/null
cp "$RUN_DIR/metrics/train.jsonl" "$OUT_DIR/train.jsonl" 2>/dev/null
# pytest's exit 5 = nothing collected to run: every test skipped for want of a GPU (--cpu-tiny);
# -n 2: pyproject's `-n auto` would start a worker (and a CUDA context) per core of the device
# (without pytest-xdist on the device, its addopts would not parse: one process, addopts cleared)
if "$PY" -c "import xdist" >/dev/null 2>&1; then WORKERS="-n 2"; else WORKERS="-o addopts="; fi
phase pytest-gpu 0,5 bash -c "set -o pipefail; '$PY' -m pytest $WORKERS -m gpu tests/training/test_gpu.py -p no:cacheprovider -rfEs 2>&1 | tee '$WORK/pytest.txt'"
phase memory-probe 0 "$PY" bench/memory_probe.py --experiment "$SMOKE" --micro-batches "$PROBE_MICRO" \
  --out "$OUT_DIR/probe.json"
if selected bench-rest; then
  LEFT=$((DEADLINE - $(date +%s) - 25))
  CAP[bench-rest]=${CAP_SET[bench-rest]:-$((LEFT + 15))}
  if [ "$LEFT" -ge 30 ] || [ -n "${CAP_SET[bench-rest]:-}" ]; then
    phase bench-rest 0 "$PY" bench/gpu_bench.py "${BENCH_FLAGS[@]}" --part rest --budget-s "$LEFT" \
      --smoke-experiment "$SMOKE" --out "$OUT_DIR/bench.json"
  else
    say "bench-rest: skipped, ${LEFT} s left"
    printf '{"phase": "bench-rest", "rc": null, "seconds": 0, "expected": [0], "note": "budget spent"}\n' >> "$PHASES"
  fi
fi
"$PY" bench/device_table.py table --out "$OUT_DIR" --work "$WORK" --command "$COMMAND" 2>>"$LOG" | tee -a "$LOG"
say "done in $(( $(date +%s) - T0 )) s; results in $OUT_DIR, work (run folder, checkpoints) in $WORK"
