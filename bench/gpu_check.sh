#!/usr/bin/env bash
# The checks that need one NVIDIA GPU (run from the repository root, with the package importable):
#   1. a one-node, one-worker job under the local launcher on cuda:0 (NCCL world of 1 for data, gloo for
#      control), fp32 and bf16, each compared with the single-process reference on the same GPU;
#   2. the per-layer profile measured on the GPU;
#   3. `python -m bench gpu_step`: the engine's step time against a plain single-GPU loop (bf16 and fp32).
# Results go to stdout and, when $OUT is set, to files under it. Usage: bash bench/gpu_check.sh
set -uo pipefail
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
$py -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
common=(training.steps=30 data.cache_dir=/tmp/gpu_check_cache logging.tensorboard_dir=/tmp/gpu_check_tb)
for prec in fp32 bf16; do
  rm -rf "/tmp/gpu_check_job_$prec" "/tmp/gpu_check_ref_$prec"
  $py -m launcher.local --nodes 1 --rdzv-conf lease_ttl=5,last_call_timeout=0.5 -- examples/train.py \
      --config configs/gpt2-tiny.yaml training.precision=$prec checkpoint.dir=/tmp/gpu_check_job_$prec "${common[@]}" \
      > "$out/job-$prec.log" 2>&1
  echo "job $prec: exit $?"; grep -E "cuda|NCCL|loss .* ->|trained steps|error|Error" "$out/job-$prec.log" | head -12
  $py examples/train.py --config configs/gpt2-tiny.yaml training.precision=$prec \
      checkpoint.dir=/tmp/gpu_check_ref_$prec "${common[@]}" > "$out/ref-$prec.log" 2>&1
  echo "reference $prec: exit $?"; grep -E "loss .* ->" "$out/ref-$prec.log"
  $py - "$prec" <<'PY'
import json, sys
import torch
from oobleck_elastic.checkpoint import load_model_state
prec = sys.argv[1]
job, ref = load_model_state(f"/tmp/gpu_check_job_{prec}"), load_model_state(f"/tmp/gpu_check_ref_{prec}")
rel = max(((job[k].float() - ref[k].float()).abs().max() / ref[k].float().abs().max().clamp_min(1e-12)).item()
          for k in ref)
print(json.dumps({"check": "job_vs_reference_on_gpu", "precision": prec, "tensors": len(ref),
                  "max_rel_diff": rel, "same_keys": set(job) == set(ref)}))
PY
done
$py - <<'PY'
import json, torch
from oobleck_elastic.config import load_config
from oobleck_elastic.planning.profile.cache import load_or_profile
cfg = load_config("configs/gpt2-small.yaml", ["data.cache_dir=/tmp/gpu_check_cache", "training.microbatch_size=4"])
prof = load_or_profile(cfg, device="cuda:0", log=print)
for layer in prof.layers[:3] + prof.layers[-1:]:
    print(json.dumps({"check": "profile_on_gpu", "layer": layer.name, "forward_ms": round(layer.forward_s * 1e3, 3),
                      "backward_ms": round(layer.backward_s * 1e3, 3), "activation_bytes": layer.activation_bytes}))
PY
$py -m bench gpu_step | tee "$out/gpu_step_bf16.jsonl"
$py -m bench gpu_step training.precision=fp32 --rounds 3 | tee "$out/gpu_step_fp32.jsonl"
