"""A running generation's communication timeout follows its first steps (config/timing.py,
`Trainer.derive_timeout`): two gloo ranks, one pipeline of two stages, enter under the first
timeout (300 s, nothing measured), derive it again between steps as a worker does, and their
groups move to it; then rank 1 stops taking part (alive, its sockets open), and rank 0's pipeline
wait is cut off at the derived timeout, not at 300 s."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from oobleck_elastic.config import from_dict, load_config, to_dict
from oobleck_elastic.testing import RandomTokens, layout_plan
import ranks

ROOT = Path(__file__).resolve().parents[2]


def _worker(rank: int, world: int, tmp: str, cfg_dict: dict) -> None:
    from oobleck_elastic.config import timing
    from oobleck_elastic.engine.trainer import Trainer

    timing.COMM_FLOOR_S = 1.0  # a job's floor (120 s) would make the cut-off below take minutes
    cfg = from_dict(cfg_dict)
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmp, "store"), world)
    store.set_timeout(timedelta(seconds=120))
    trainer = Trainer(
        cfg, dataset=RandomTokens(), plan=layout_plan([[(0, 3), (3, 6)]], [4], generation=1), rank=rank, store=store
    )
    first = trainer.timeout.total_seconds()
    seconds: list[float] = []
    for step in range(3):
        seconds.append(trainer.train_step(step).seconds)
        trainer.derive_timeout(timing.typical_step(seconds), running=True)  # as engine/worker.py does
    assert trainer.groups is not None and trainer.groups.pipeline_group is not None
    backends = [g._get_backend(torch.device("cpu")) for g in (dist.group.WORLD, trainer.groups.pipeline_group)]
    record = {
        "first": first,
        "derived": trainer.timeout.total_seconds(),
        "groups": [b.options._timeout.total_seconds() for b in backends],
        "p2p": trainer.progress.p2p_timeout.total_seconds() if trainer.progress.p2p_timeout else None,
    }
    if rank == 0:  # rank 1 never posts its part of step 4: a stuck peer, not a dead one
        began = time.monotonic()
        try:
            trainer.train_step(3)
        except Exception as err:  # noqa: BLE001 - the cut-off under test
            record["cut_off_s"], record["error"] = time.monotonic() - began, str(err)[:300]
        store.set("done", "1")
    else:
        try:
            store.wait(["done"])  # alive, its sockets open, until rank 0 has given up on it
        except RuntimeError:  # 120 s: rank 0 was not cut off; leaving ends its wait (asserted below)
            pass
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(record))
    os._exit(0)  # rank 0's broken generation: no orderly teardown needed


def test_a_running_generation_follows_its_first_steps_and_a_stuck_peer_is_cut_off_at_the_derived_timeout(
    tmp_path: Path,
) -> None:
    cfg = load_config(
        ROOT / "configs/gpt2-tiny.yaml",
        [
            "data.seq_len=16",
            "training.global_batch_size=8",
            "training.microbatch_size=2",
            "training.steps=4",
            "fault_tolerance.hang_floor_s=2",  # the timeout is 6 s or more: no step of a loaded machine waits that long
            "fault_tolerance.hang_factor=4",  # or 12 typical steps (3 x 4)
        ],
    )
    ranks.spawn(_worker, args=(2, str(tmp_path), to_dict(cfg)), nprocs=2)
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in records:
        assert r["first"] == 300.0 and r["derived"] < 100.0, r  # derived from the measured steps
        assert r["groups"] == pytest.approx([r["derived"]] * 2, abs=1e-3), r  # every group follows (in ms)
        assert r["p2p"] == r["derived"], r
    r0 = records[0]
    assert "cut_off_s" in r0, r0  # step 4 failed on rank 0
    assert 0.8 * r0["derived"] <= r0["cut_off_s"] < r0["derived"] + 30.0, r0  # the derived bound, not 300 s
    print(f"derived {r0['derived']:.2f} s; rank 0 cut off after {r0['cut_off_s']:.2f} s: {r0['error'][:120]}")
