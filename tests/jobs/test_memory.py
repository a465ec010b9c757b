"""A worker holds its stage, not the model: four torchrun nodes run one 4-stage pipeline of a GPT-2
whose full size is about four times a stage's, and every worker's peak resident memory before its
first step grows from its start by no more than its stage's parameters plus a constant that does
not depend on the model (before, every worker built every layer first: the whole model), with
random initial weights and with a pretrained Hugging Face directory (read per layer)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from oobleck_elastic.testing import uniform_profile
from helpers import run_job, tensorboard_run

pytestmark = pytest.mark.slow

BLOCKS, HIDDEN = 16, 768  # 16 blocks of 7.1 M parameters: 453 MB of fp32 weights in all
# what a worker adds whatever the model: code imported on first use (transformers' model classes,
# torch's pipelining), gloo groups and their threads, a parameter drawn on the CPU at a time;
# measured 88-103 MB on this stage split (the whole model, as every worker built it before: 453 MB)
CONSTANT = 160e6
MEMORY = re.compile(
    r"gen (\d+) step 0 node (\S+) rank (\d+): memory on entering: peak RSS ([\d.]+) GB; holds layers "
    r"\[(\d+), (\d+)\), ([\d.]+) GB of parameters and optimizer state; resident at start ([\d.]+) GB"
)


def four_stage_profile(path: Path, layers: int) -> Path:
    """`layers` layers of 0.4 GiB (params+grads+AdamW) on 2.1 GiB devices: at most 5 layers per
    device, so with f=0 four nodes run one 4-stage pipeline."""
    uniform_profile(layers).save(path)
    return path


def save_pretrained_gpt2(path: Path) -> Path:
    """A random GPT-2 of the test's shape written by Hugging Face (sharded safetensors)."""
    import transformers

    config = transformers.GPT2Config(
        vocab_size=256,
        n_positions=64,
        n_embd=HIDDEN,
        n_layer=BLOCKS,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    transformers.GPT2LMHeadModel(config).save_pretrained(path, max_shard_size="100MB")
    assert (path / "model.safetensors.index.json").exists()
    return path


@pytest.mark.parametrize("weights", ["random", pytest.param("pretrained", marks=pytest.mark.extended)])
def test_every_worker_holds_its_stage_not_the_model(tmp_path: Path, etcd_server, run_id, weights: str) -> None:
    profile = four_stage_profile(tmp_path / "profile.json", BLOCKS + 2)
    extra = [
        f"model.num_layers={BLOCKS}",
        f"model.hidden_size={HIDDEN}",
        "model.num_heads=4",
        "fault_tolerance.f=0",
        "planning.device_memory_gb=2.1",
        "data.seq_len=16",
        "training.global_batch_size=4",
        "training.microbatch_size=1",
    ]
    if weights == "pretrained":
        extra.append(f"model.pretrained_path={save_pretrained_gpt2(tmp_path / 'gpt2')}")
    out, _, _ = run_job(tmp_path, etcd_server, run_id, ["--nodes", "4"], 1, profile, extra=extra, reference=False)
    found = MEMORY.findall(out)
    assert len(found) == 4, out[-5000:]
    full = 0
    for _, node, rank, peak, start, end, held, at_start in found:
        growth = (float(peak) - float(at_start)) * 1e9
        held_bytes = float(held) * 1e9
        full += held_bytes
        assert int(end) - int(start) <= 5, f"rank {rank} holds layers [{start}, {end})"
        assert growth < held_bytes + CONSTANT, (
            f"node {node} rank {rank} grew by {growth / 1e6:.0f} MB before its "
            f"first step for a stage of {held_bytes / 1e6:.0f} MB"
        )
    assert full > 4e8  # the whole model: several times any stage
    assert max(float(h) for *_, h, _ in found) * 1e9 < full / 3
    # TensorBoard has the largest worker's peak (carried in the step's commit all-reduce)
    ea = EventAccumulator(str(tensorboard_run(tmp_path / "job" / "runs")), size_guidance={"scalars": 0})
    ea.Reload()
    peak = ea.Scalars("memory/peak_rss_gb")[-1].value
    assert max(float(p) for _, _, _, p, *_ in found) <= peak < 4, peak
