"""Paced devices (engine/stage/paced.py): the padding decision on made-up numbers, the wrapper on a
made-up stage, and a two-stage job whose passes are padded to the plan's times x the factor
(lower bounds only: a sleep makes a pass at least that long, whatever the machine)."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from oobleck_elastic.config import from_dict, load_config, to_dict
from oobleck_elastic.engine.trainer import Trainer
from oobleck_elastic.engine.stage.paced import PaceTargets, pace_stage, pace_targets, padding_s, pass_of
from oobleck_elastic.planning import StagePlacement
from helpers import RandomTokens, layout_plan
import ranks

ROOT = Path(__file__).resolve().parents[2]


def test_targets_split_the_plans_times_and_scale_them() -> None:
    # 10 ms forward of 40 ms: backward 30 ms, split 0.5 into input and weight gradients; x 3
    t = pace_targets(0.040, 0.010, 3.0, weight_share=0.5)
    assert t == PaceTargets(
        forward_s=pytest.approx(0.030), input_grad_s=pytest.approx(0.045), weight_grad_s=pytest.approx(0.045)
    )
    assert t.backward_s == pytest.approx(0.090)
    assert [t.of(p) for p in ("forward", "backward", "input_grad", "weight_grad")] == [
        pytest.approx(x) for x in (0.030, 0.090, 0.045, 0.045)
    ]
    # another weight share
    assert pace_targets(0.040, 0.010, 1.0, weight_share=0.25).weight_grad_s == pytest.approx(0.0075)
    # no forward_s in the plan (0) or a nonsensical one: forward a third, backward two thirds
    for unknown in (0.0, 0.05):
        u = pace_targets(0.030, unknown, 2.0)
        assert (u.forward_s, u.backward_s) == (pytest.approx(0.020), pytest.approx(0.040))
    # off: factor 0, or a stage the plan gives no time
    assert pace_targets(0.040, 0.010, 0.0) == PaceTargets(0.0, 0.0, 0.0)
    assert pace_targets(0.0, 0.0, 5.0) == PaceTargets(0.0, 0.0, 0.0)


def test_padding_fills_up_to_the_target_and_never_shortens() -> None:
    assert padding_s(0.100, 0.030) == pytest.approx(0.070)
    assert padding_s(0.100, 0.100) == 0.0
    assert padding_s(0.100, 0.250) == 0.0  # an overrun is not shortened
    assert padding_s(0.0, 0.001) == 0.0


def test_which_pass_a_stage_call_makes() -> None:
    assert pass_of("forward_one_chunk", (0, ()), {}) == "forward"
    assert pass_of("backward_one_chunk", (0,), {"loss": None}) == "backward"
    assert pass_of("backward_one_chunk", (0,), {"full_backward": True}) == "backward"
    assert pass_of("backward_one_chunk", (0,), {"full_backward": False}) == "input_grad"
    assert pass_of("backward_one_chunk", (0, None, False), {}) == "input_grad"
    assert pass_of("backward_weight_one_chunk", (0,), {}) == "weight_grad"
    with pytest.raises(ValueError, match="step is no pass of a pipeline stage"):
        pass_of("step", (), {})


class _Stage:
    """A made-up pipeline stage: each pass returns at once."""

    def forward_one_chunk(self, i, args, kwargs=None):
        return ("f", i)

    def backward_one_chunk(self, i, loss=None, full_backward=True, last_backward=False):
        return ("b" if full_backward else "i", i)

    def backward_weight_one_chunk(self, i, last_backward=False):
        return ("w", i)


def test_pace_stage_pads_every_pass_of_a_stage() -> None:
    stage = StagePlacement(index=0, start=0, end=2, node="n0", local_rank=0, rank=0, compute_s=0.012, forward_s=0.004)
    assert pace_stage(_Stage(), stage, 0.0, device=torch.device("cpu")) is None  # off: nothing wrapped
    chunked = dataclasses.replace(stage, chunks=((0, 1), (3, 4)))  # the plan's times are the device's
    assert pace_stage(_Stage(), chunked, 2.0, device=torch.device("cpu")) is None
    # with each chunk's times, each chunk is paced to its own: chunk 1 forward 2 x 5 ms
    timed = dataclasses.replace(chunked, chunk_times=((0.003, 0.001), (0.015, 0.005)))
    second = pace_stage(_Stage(), timed, 2.0, device=torch.device("cpu"), chunk=1)
    assert second is not None and second.targets.forward_s == pytest.approx(0.010)
    assert second.targets.backward_s == pytest.approx(0.020)
    pstage = _Stage()
    pacer = pace_stage(pstage, stage, 2.0, device=torch.device("cpu"))
    assert pacer is not None
    t0 = time.perf_counter()
    assert pstage.forward_one_chunk(0, ()) == ("f", 0)  # results pass through
    assert pstage.backward_one_chunk(0, loss=None) == ("b", 0)
    assert pstage.backward_one_chunk(1, loss=None, full_backward=False) == ("i", 1)
    assert pstage.backward_weight_one_chunk(1) == ("w", 1)
    took = time.perf_counter() - t0
    # targets: forward 8 ms, backward 16 ms, input and weight gradients 8 ms each
    assert pacer.calls == {"forward": 1, "backward": 1, "input_grad": 1, "weight_grad": 1}
    for pass_, target in (("forward", 0.008), ("backward", 0.016), ("input_grad", 0.008), ("weight_grad", 0.008)):
        assert pacer.wall_s[pass_] >= target, (pass_, pacer.wall_s)
    assert took >= 0.040
    assert pacer.overruns == 0


STEPS = 2
MICROBATCHES = 4
FACTOR = 2.0
COMPUTE_S, FORWARD_S = 0.030, 0.010  # per stage and microbatch, as a plan would carry them


def _paced_plan():
    plan = layout_plan([[(0, 3), (3, 6)]], [MICROBATCHES], generation=1)
    pipe = plan.pipelines[0]
    stages = tuple(dataclasses.replace(s, compute_s=COMPUTE_S, forward_s=FORWARD_S) for s in pipe.stages)
    return dataclasses.replace(plan, pipelines=(dataclasses.replace(pipe, stages=stages),))


def _worker(rank: int, world: int, tmp: str, cfg_dict: dict) -> None:
    cfg = from_dict(cfg_dict)
    store = dist.FileStore(os.path.join(tmp, "store"), world)
    trainer = Trainer(cfg, dataset=RandomTokens(), plan=_paced_plan(), rank=rank, store=store)
    seconds = [trainer.train_step(step).seconds for step in range(STEPS)]
    pacer = trainer.pacer
    assert pacer is not None
    got = {
        "threads": torch.get_num_threads(),
        "seconds": seconds,
        "calls": pacer.calls,
        "wall_s": pacer.wall_s,
        "targets": dataclasses.asdict(pacer.targets),
    }
    (Path(tmp) / f"rank{rank}.json").write_text(json.dumps(got))
    trainer.close()


@pytest.mark.slow
def test_a_paced_job_pads_each_pass_to_the_plans_time(tmp_path: Path) -> None:
    """Two stages, 4 microbatches, 2 steps at factor 2 of a plan giving each stage 30 ms (10 ms
    forward): every forward and backward of every microbatch was padded, each lasted at least its
    target (20 ms, 40 ms), and a step of each stage at least its 4 x 60 ms of passes, which the tiny
    model's arithmetic (a few ms) is far from."""
    cfg = load_config(
        ROOT / "configs/gpt2-tiny.yaml",
        [
            "data.seq_len=16",
            "training.global_batch_size=8",
            "training.microbatch_size=2",
            f"training.paced_devices={FACTOR}",
        ],
    )
    ranks.spawn(_worker, args=(2, str(tmp_path), to_dict(cfg)), nprocs=2)
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["threads"] == 1  # pinned
        assert got["targets"] == pytest.approx({"forward_s": 0.020, "input_grad_s": 0.020, "weight_grad_s": 0.020})
        assert got["calls"] == {"forward": STEPS * MICROBATCHES, "backward": STEPS * MICROBATCHES}
        assert got["wall_s"]["forward"] / got["calls"]["forward"] >= 0.020, got
        assert got["wall_s"]["backward"] / got["calls"]["backward"] >= 0.040, got
        for seconds in got["seconds"]:
            assert seconds >= MICROBATCHES * FACTOR * COMPUTE_S, got


def test_an_overrun_is_counted_and_logged_once_after_the_first_step(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from oobleck_elastic.engine.stage.paced import Pacer
    from oobleck_elastic.logs import JobLog

    step = [3]
    pacer = Pacer(
        PaceTargets(0.001, 0.0, 0.0),
        log=JobLog(logging.getLogger("paced-test"), gen=2, node="n0"),
        step=lambda: step[0],
    )
    forward = pacer.paced(lambda i, args: time.sleep(0.004), "forward_one_chunk")
    with caplog.at_level(logging.WARNING, logger="paced-test"):
        forward(0, ())  # the stage's first step: one-off costs, counted, not logged
        assert caplog.messages == []
        step[0] = 4
        forward(0, ())
        forward(1, ())
    assert pacer.overruns == 3
    assert len(caplog.messages) == 1
    assert caplog.messages[0].startswith("gen 2 step 4 node n0: paced device: a forward took ")
    assert caplog.messages[0].endswith("more than its 1.0 ms target; raise training.paced_devices")
