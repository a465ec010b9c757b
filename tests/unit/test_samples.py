"""The sample ledger (records/samples.py): its check on made-up ledgers (a skip, a repeat, a gap,
a replay, a roll-forward, a restore that re-runs steps, a shifted pipeline, a missing record),
`oobleck samples --check`, and the single process's own ledger, right and with its sampler broken."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


from oobleck_elastic import cli
from oobleck_elastic.records.samples import EVENT, check, describe, runs

ROOT = Path(__file__).resolve().parents[2]
B, K = 8, 4  # batch, steps per epoch


class Ledger:
    """Made-up ledger lines, in time order."""

    def __init__(self, steps: int = 6) -> None:
        self.steps, self.lines, self.t = steps, [], 0.0

    def _add(self, **line) -> None:
        self.t += 1.0
        self.lines.append({"t": self.t, "event": EVENT, **line})

    def fed(self, step: int, gen: int, slices=((0, B),), shift: int = 0, only=None) -> None:
        epoch, block = divmod(step, K)
        for p, (a, b) in enumerate(slices):
            if only is not None and p not in only:
                continue
            positions = [[block * B + a + shift, block * B + b + shift]] if b > a else []
            self._add(
                kind="fed",
                gen=gen,
                step=step,
                pipeline=p,
                pipelines=len(slices),
                slice=[a, b],
                batch=B,
                steps_per_epoch=K,
                steps=self.steps,
                epoch=epoch,
                positions=positions,
            )

    def applied(self, step: int, gen: int, *, workers: int = 2, how: str = "step", first: int = 0) -> None:
        for rank in range(first, first + workers):
            self._add(kind="applied", gen=gen, step=step, how=how, node=f"node{rank}", rank=rank)

    def skipped(self, step: int, gen: int) -> None:
        self._add(kind="skipped", gen=gen, step=step, node="node0", rank=0)

    def restored(self, step: int, gen: int) -> None:
        self._add(kind="restored", gen=gen, step=step)

    def run(self, steps, gen: int, slices=((0, B),)) -> None:
        for s in steps:
            self.fed(s, gen, slices)
            self.applied(s, gen)


TWO = ((0, 6), (6, 8))  # two pipelines of 3 and 1 microbatches of 2
THREE = ((0, 4), (4, 6), (6, 8))


def test_runs() -> None:
    assert runs([5, 3, 4, 9, 10, 0]) == [[0, 1], [3, 6], [9, 11]]
    assert runs([2, 2, 3]) == [[2, 3], [2, 4]]  # a position taken twice stays visible
    assert runs([]) == []


def test_a_job_through_a_join_a_failure_with_a_roll_forward_a_replay_and_a_skip_is_exactly_once() -> None:
    led = Ledger(steps=10)
    led.run(range(0, 3), 1, TWO)
    led.run(range(3, 5), 2, THREE)  # a join: three pipelines
    led.fed(5, 2, THREE)  # a failure after the commit of step 5: one worker applied it in the step,
    led.applied(5, 2, workers=1)
    led.applied(5, 2, workers=1, how="roll_forward", first=1)  # another rolled it forward entering generation 3
    led.fed(6, 3, TWO)  # step 6 broke before its commit in generation 3: replayed in 4
    led.run([6], 4, TWO)
    led.fed(7, 4, TWO)  # the guard rejected step 7 once (replayed), then it went through
    led.fed(7, 4, TWO)
    led.applied(7, 4)
    led.fed(8, 4, TWO)
    led.fed(8, 4, TWO)
    led.skipped(8, 4)  # rejected twice: skipped
    led.run([9], 4, TWO)  # epoch 2 starts at step 8
    report = check(led.lines)
    assert report.problems == []
    assert (report.steps, report.applied, report.skipped, report.reruns) == (10, 9, [8], 3)
    assert describe(report) == [
        "samples: exactly once: 9 of 10 steps applied, 1 skipped by the step guard (step(s) 8); 3 attempt(s) "
        "not counted (replays, broken generations, re-runs after 0 restore(s)); generations 1-4"
    ]


def test_a_step_applied_in_two_generations_is_a_repeat() -> None:
    led = Ledger(steps=3)
    led.run(range(3), 1)
    led.run([2], 2)  # step 2 run again after a re-plan, without a restore
    assert check(led.lines).problems == [
        "step 2 committed 2 times (applied in generation 1, applied in generation 2): its samples were repeated"
    ]


def test_a_skipped_and_applied_step_is_a_repeat_and_a_missing_step_a_gap() -> None:
    led = Ledger(steps=5)
    led.run([0, 1], 1)
    led.fed(2, 1)
    led.skipped(2, 1)
    led.applied(2, 1)
    led.run([4], 1)  # step 3 never committed
    assert check(led.lines).problems == [
        "never committed: step(s) 3",
        "step 2 committed 2 times (applied in generation 1, skipped in generation 1): its samples were repeated",
    ]


def test_a_restore_undoes_the_steps_after_its_checkpoint_and_they_run_again() -> None:
    led = Ledger(steps=6)
    led.run(range(6), 1)  # steps 4 and 5 applied in generation 1, then every copy of a layer lost
    led.restored(4, 2)  # the checkpoint of step 4 restored entering generation 2
    led.run([4, 5], 2)
    report = check(led.lines)
    assert (report.problems, report.restores, report.reruns) == ([], 1, 2)
    led.lines = [line for line in led.lines if line["kind"] != "restored"]  # without the restore record
    assert check(led.lines).problems == [
        "step 4 committed 2 times (applied in generation 1, applied in generation 2): its samples were repeated",
        "step 5 committed 2 times (applied in generation 1, applied in generation 2): its samples were repeated",
    ]


def test_a_restore_by_several_workers_is_one_even_when_a_batch_is_taken_between_their_records() -> None:
    led = Ledger(steps=6)
    led.run(range(6), 1, TWO)
    led.restored(4, 2)  # node3 restored first and fed step 4 while node1 was still restoring
    led.fed(4, 2)
    led.restored(4, 2)
    led.applied(4, 2)
    led.run([5], 2)
    report = check(led.lines)
    assert (report.problems, report.restores, report.reruns) == ([], 1, 2)


def test_a_restore_at_the_jobs_start_resumes_a_stopped_job() -> None:
    led = Ledger(steps=4)
    led.run(range(3), 1)  # a first run stopped after step 2 (its checkpoint: step 2)
    led.restored(2, 1)  # the job started again: generation 1 again, resumed at step 2, on two pipelines
    led.run([2, 3], 1, TWO)
    assert check(led.lines).problems == []


def test_a_pipeline_shifted_by_one_sample_repeats_one_and_leaves_one_out() -> None:
    led = Ledger(steps=3)
    led.run([0], 1, TWO)
    led.fed(1, 1, TWO, only=[0])
    led.fed(1, 1, TWO, only=[1], shift=1)  # pipeline 1 takes one position too far: 14 left out
    led.applied(1, 1)
    led.run([2], 1, TWO)  # 16 is step 2's first sample
    assert check(led.lines).problems == [
        "step 1 (fed in generation 1): pipeline 1 consumed positions [15,17) of epoch 0; the sampler's batch "
        "gives it [14,16) of epoch 0",
        "step 2 (fed in generation 1): positions [16,17) of epoch 0 were consumed by step 1 too",
    ]


def test_positions_consumed_by_two_steps_are_named() -> None:
    led = Ledger(steps=2)
    led.run([0], 1)
    led.fed(1, 1, shift=-B)  # step 1 fed step 0's block again
    led.applied(1, 1)
    assert check(led.lines).problems == [
        "step 1 (fed in generation 1): pipeline 0 consumed positions [0,8) of epoch 0; the sampler's batch "
        "gives it [8,16) of epoch 0",
        "step 1 (fed in generation 1): positions [0,8) of epoch 0 were consumed by step 0 too",
    ]


def test_slices_that_overlap_or_leave_samples_out() -> None:
    led = Ledger(steps=2)
    led.fed(0, 1, ((0, 6), (4, 8)))
    led.applied(0, 1)
    led.fed(1, 1, ((0, 4), (6, 8)))
    led.applied(1, 1)
    assert check(led.lines).problems == [
        "step 0 (fed in generation 1): pipeline 1's slice [4,8) of the batch starts at 4, not 6: samples overlap",
        "step 0 (fed in generation 1): positions [4,6) of epoch 0 were consumed twice in this step "
        "(pipeline 1 and an earlier one)",
        "step 1 (fed in generation 1): pipeline 1's slice [6,8) of the batch starts at 6, not 4: samples are left out",
    ]


def test_an_applied_step_needs_every_pipelines_record_and_the_same_samples_in_every_attempt() -> None:
    led = Ledger(steps=2)
    led.fed(0, 1, TWO, only=[0])
    led.applied(0, 1)
    led.fed(1, 1, TWO)
    led.fed(1, 1, TWO, only=[1], shift=1)
    led.applied(1, 1)
    assert check(led.lines).problems == [
        "step 0 (fed in generation 1): no record of what pipeline(s) [1] of 2 consumed",
        "step 1 (fed in generation 1): pipeline 1 consumed different samples in its attempts: slice (6, 8) "
        "epoch 0 positions [14,16); slice (6, 8) epoch 0 positions [15,17)",
    ]


def test_malformed_lines_and_no_records_are_problems() -> None:
    assert check([]).problems == ["no sample ledger records (was logging.events_dir set for the job?)"]
    led = Ledger(steps=1)
    led.run([0], 1)
    led.lines.append({"t": 99.0, "event": EVENT, "kind": "fed", "gen": 1, "step": 0})
    (problem,) = check(led.lines).problems
    assert problem.startswith("unreadable ledger line (KeyError: 'slice'): ")


def test_the_samples_command(tmp_path: Path, capsys) -> None:
    led = Ledger(steps=2)
    led.run([0, 1], 1)
    (tmp_path / "events-h-1.jsonl").write_text("".join(json.dumps(line) + "\n" for line in led.lines))
    assert cli.main(["samples", "--check", "--events-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("samples: exactly once: 2 of 2 steps applied")
    assert cli.main(["samples", "--check", "--events-dir", str(tmp_path), "--steps", "3"]) == 1
    assert capsys.readouterr().out.splitlines()[1] == "  never committed: step(s) 2"
    assert cli.main(["samples", "--check", "--events-dir", str(tmp_path / "none")]) == 2
    assert f"no events directory {tmp_path / 'none'}" in capsys.readouterr().err


def _single_process(tmp_path: Path, monkeypatch, *, nan: bool = True, extra: tuple[str, ...] = ()) -> list[str]:
    from oobleck_elastic import cluster_ops
    from oobleck_elastic.config import load_config
    from oobleck_elastic.engine.run import train

    cfg = load_config(
        ROOT / "configs/gpt2-tiny.yaml",
        [
            "data.seq_len=16",
            "training.global_batch_size=8",
            "training.microbatch_size=2",
            "training.steps=6",
            f"checkpoint.dir={tmp_path / 'ckpt'}",
            f"logging.events_dir={tmp_path / 'events'}",
            f"logging.tensorboard_dir={tmp_path / 'runs'}",
            f"data.cache_dir={tmp_path / 'cache'}",
            *extra,
        ],
    )
    if nan:
        monkeypatch.setenv("OOBLECK_NAN_AT", "0@3x2")  # step 4 replayed, then skipped
    train(cfg)
    return cluster_ops.samples(str(tmp_path / "events"))[1]


def test_the_single_process_ledger_is_exactly_once_with_a_skip(tmp_path: Path, monkeypatch) -> None:
    lines = _single_process(tmp_path, monkeypatch)
    assert lines[0].startswith(
        "samples: exactly once: 5 of 6 steps applied, 1 skipped by the step guard (step(s) 3); 1 attempt(s) not counted"
    ), lines


def test_a_sampler_that_repeats_a_sample_fails_the_check(tmp_path: Path, monkeypatch) -> None:
    """The negative control: step 5 (0-based 4) takes its first sample from step 3's batch (0-based 2)."""
    from oobleck_elastic.engine.trainer import Trainer

    right = Trainer.my_samples

    def wrong(self, step: int) -> list[int]:
        out = right(self, step)
        return [self.sampler.indices(step - 2)[-1], *out[1:]] if step == 4 else out

    monkeypatch.setattr(Trainer, "my_samples", wrong)
    lines = _single_process(tmp_path, monkeypatch)
    assert lines[0].startswith("samples: NOT exactly once (2 problem(s))"), lines
    assert lines[1:] == [
        "  step 4 (fed in generation 1): pipeline 0 consumed positions [23,24) [33,40) of epoch 0; the sampler's "
        "batch gives it [32,40) of epoch 0",
        "  step 4 (fed in generation 1): positions [23,24) of epoch 0 were consumed by step 2 too",
    ], lines


def test_a_rolled_forward_step_is_recorded_against_the_generation_that_fed_it(tmp_path: Path, monkeypatch) -> None:
    """Step 1's commit never returns here (a peer died in it); the entry of the next generation
    rolls its synchronised gradients forward (`roll_forward`, what GenerationEntry calls): the
    ledger counts that one application, of generation 1's batch."""
    import logging

    from oobleck_elastic.config import load_config
    from oobleck_elastic.engine import trainer as trainer_module
    from oobleck_elastic.engine.reference import single_process
    from oobleck_elastic.logs import attach_event_lines, read_event_lines
    from helpers import RandomTokens

    cfg = load_config(
        ROOT / "configs/gpt2-tiny.yaml",
        [
            "data.seq_len=8",
            "training.global_batch_size=8",
            "training.microbatch_size=2",
            "training.steps=3",
            f"logging.events_dir={tmp_path / 'ev'}",
        ],
    )
    handler = attach_event_lines(tmp_path / "ev")
    t = single_process(cfg, dataset=RandomTokens(n=32, seq_len=8))
    try:
        t.train_step(0)
        with monkeypatch.context() as m:
            m.setattr(trainer_module, "commit", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("peer died")))
            with pytest.raises(RuntimeError, match="peer died"):
                t.train_step(1)
        assert (t.state.synced_step, t.committed_step) == (1, 0)
        t._roll_forward(t.state.synced_step, t.state.synced_norm2)
        t.train_step(2)
    finally:
        t.close()
        logging.getLogger("oobleck_elastic").removeHandler(handler)
        handler.close()
    lines = read_event_lines(tmp_path / "ev", [EVENT])
    assert [(x["kind"], x["step"], x.get("how")) for x in lines if x["kind"] != "fed"] == [
        ("applied", 0, "step"),
        ("applied", 1, "roll_forward"),
        ("applied", 2, "step"),
    ]
    report = check(lines)
    assert (report.problems, report.applied, report.reruns) == ([], 3, 0)


def test_a_job_resumed_from_an_older_checkpoint_runs_steps_again_and_counts_them_once(
    tmp_path: Path, monkeypatch
) -> None:
    """Six steps with a checkpoint every 2; the checkpoints of steps 4 and 6 are then gone, so the
    job started again resumes from step 2 and re-runs steps 2-5 (a `restored` record)."""
    import shutil

    from oobleck_elastic.checkpoint import step_dir
    from oobleck_elastic.logs import read_event_lines

    _single_process(tmp_path, monkeypatch, nan=False, extra=("checkpoint.interval_steps=2",))
    for step in (4, 6):
        shutil.rmtree(step_dir(tmp_path / "ckpt", step))
    lines = _single_process(tmp_path, monkeypatch, nan=False, extra=("checkpoint.interval_steps=2",))
    assert lines == [
        "samples: exactly once: 6 of 6 steps applied, 0 skipped by the step guard (none); 4 attempt(s) not counted "
        "(replays, broken generations, re-runs after 1 restore(s)); generations 1"
    ]
    without = [x for x in read_event_lines(tmp_path / "events", [EVENT]) if x["kind"] != "restored"]
    assert check(without).problems == [
        f"step {s} applied 2 times in generation 1 by node local rank 0: its samples were repeated" for s in range(2, 6)
    ]
