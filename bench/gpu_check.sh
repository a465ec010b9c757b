#!/usr/bin/env bash
# The one-GPU checks: one JSON line per check on stdout (logs on stderr), nothing appended anywhere.
# Run from the repository root with the package importable, on a machine with one NVIDIA GPU
# (about 8 minutes, an estimate): bash bench/gpu_check.sh
# --dry-run runs each check's CPU half (small sizes, on any machine) and prints the same lines;
# --only CHECK... runs some of them. What each check proves and its bound: docs/gpu.md.
# Exit status: 0 every check passed, 1 one failed, 2 no GPU (and no --dry-run).
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
dry=0
for arg in "$@"; do [[ $arg == --dry-run ]] && dry=1; done
if [[ $dry == 0 ]] && ! $py -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "bench/gpu_check.sh needs a CUDA GPU (none here); run bash bench/gpu_check.sh --dry-run for the CPU half" >&2
  exit 2
fi
exec $py -m bench gpu_checks "$@"
