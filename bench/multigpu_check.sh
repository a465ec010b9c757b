#!/usr/bin/env bash
# The first multi-GPU machine's checks: two machines of 4 GPUs as one job (four nodes of two
# workers), a kill, a join, a drain and a leader kill under NCCL, each against the single-process
# reference; one JSON line per scenario and machine (bench/multigpu.py; docs/gpu.md).
# On both machines, from the repository root, with the same TAG, ENDPOINT and SHARED folder:
#   machine 0:  oobleck etcd --host ADDR0 &     # once; or any etcd both machines reach
#   machine 0:  bash bench/multigpu_check.sh --machine 0 --endpoint ADDR0:2379 --shared /nfs/x --tag T
#   machine 1:  bash bench/multigpu_check.sh --machine 1 --endpoint ADDR0:2379 --shared /nfs/x --tag T
# --dry-run validates every command and config of both machines (seconds, any machine, no GPU);
# it does not run the scenarios; --cpu runs them on CPUs under gloo (both drivers may share a machine).
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
dry=0
for arg in "$@"; do [[ $arg == --dry-run || $arg == --cpu ]] && dry=1; done
if [[ $dry == 0 ]] && ! $py -c "import torch, sys; sys.exit(0 if torch.cuda.device_count() >= 4 else 1)" 2>/dev/null; then
  echo "bench/multigpu_check.sh needs 4 CUDA GPUs on this machine; --dry-run validates its commands and configs" >&2
  exit 2
fi
exec $py -m bench multigpu "$@"
