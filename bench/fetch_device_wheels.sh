#!/usr/bin/env bash
# Fill bench/wheels/ with what bench/device_check.sh needs on a GPU machine that has no internet.
#
#   bash bench/fetch_device_wheels.sh            # here, where pip reaches an index (a few MB, seconds)
#   bash bench/fetch_device_wheels.sh --check    # only list what is there and its size; exit 1 if incomplete
#
# The lent H200 machine has Python 3.12, torch, transformers, accelerate, huggingface_hub, triton,
# nvidia-ml-py, pandas, pyarrow, psutil and typing_inspect, but not omegaconf, pandera (and its
# pydantic) or liger-kernel. Their wheels are downloaded for cp312 manylinux x86_64, one version each,
# without dependencies (each one that is missing there is named here), into bench/wheels/, which git
# ignores and the device `run` carries (carry: ["bench/wheels"]). mlflow is left out on purpose: with
# its server and database dependencies it is over the carry limit; the device check runs --no-tracking.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEST=$ROOT/bench/wheels
# Pinned to the versions this project's CI installs (pyproject + install.sh), so both run the same code.
WHEELS=(
  omegaconf==2.4.0
  pandera==0.35.0
  pydantic==2.13.4
  pydantic-core==2.46.4
  annotated-types==0.7.0
  typing-inspection==0.4.2
  typing-extensions==4.16.0
  typeguard==4.6.1
  liger-kernel==0.8.5
)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)

check() {
  local missing=0 name
  for spec in "${WHEELS[@]}"; do
    name=${spec%%==*}
    if ! ls "$DEST"/"${name//-/_}"-"${spec##*==}"-*.whl >/dev/null 2>&1; then
      echo "missing: $spec"
      missing=1
    fi
  done
  du -ch "$DEST"/*.whl 2>/dev/null | tail -1
  return $missing
}

if [ "${1:-}" = "--check" ]; then
  check
  exit $?
fi
mkdir -p "$DEST"
args=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --dest "$DEST")
for p in "${PLATFORMS[@]}"; do args+=(--platform "$p"); done
# (this machine's pip config names local index folders that hold none of these: drop that noise)
python3 -m pip download -q "${args[@]}" "${WHEELS[@]}" 2> >(grep -v "is ignored: it is neither a file" >&2)
ls -1 "$DEST"
check
