#!/usr/bin/env bash
# Installs the project and its test tools (the `eval` extra: lm-eval, a consumer the export tests load
# with) into the current Python environment.
# torch: GPU users bring their own build; where none is installed, the CPU wheel 2.13.0 is used
# (the dependency range stays open so a CUDA/ROCm torch already present is kept).
set -euo pipefail
cd "$(dirname "$0")"
python -m pip --version >/dev/null
if ! python -c "import torch" >/dev/null 2>&1; then
  python -m pip install --quiet "torch==2.13.0"
fi
python -m pip install --quiet -e ".[dev,eval]"
