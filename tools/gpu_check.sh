#!/usr/bin/env bash
# The main job end to end on one GPU, or at tiny sizes on CPU with --cpu (`mhf-dist gpu-check`, with this checkout's
# .venv; mhf_dist/commands/gpu_check/__init__.py says what it checks).
# Usage: bash tools/gpu_check.sh [--cpu] [--out DIR] [--work DIR] [--nominal-tflops TFLOPS] [--skip NAMES]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="$root/.venv/bin/python"
[ -x "$python" ] || python=python3
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m mhf_dist gpu-check "$@"
