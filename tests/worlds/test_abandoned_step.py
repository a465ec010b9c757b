"""An abandoned step's thread that wakes up after its worker entered the next generation touches
nothing of that generation (engine/trainer.py `train_step`, engine/step/apply.py).

Two gloo ranks run one pipeline of two stages. At step 1 rank 0's step thread is held as it
starts the step (as a paced rank 0 sleeps there, tests/helpers.py `paced`) and both ranks
abandon the step, abort and enter generation 2 on the same layout. Then rank 0's held thread is
let go: it must end at once with StepAbandoned. Before the fix it went on to take the next
generation's schedule and ran step 1 on it beside that generation's own step thread; in a chaos
run a stage's backward then found no cached forward (`KeyError: 0` in torch's stage.py), a
worker's fatal error for another node's failure. The weights after generation 2's steps equal
the single-process reference. A one-stage pipeline (one process) shows the same in-process: the
late thread ran its forward and backward on the next generation's layers.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.distributed as dist

from oobleck_elastic.config import from_dict, load_config, to_dict
from oobleck_elastic.engine.resilience.errors import StepAbandoned
from oobleck_elastic.engine.runner import StepRunner, abandoned_threads
from oobleck_elastic.engine.trainer import Trainer
import helpers
import ranks
from helpers import RandomTokens, layout_plan

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
LAYOUT = [[(0, 3), (3, 6)]]
PLANS = [layout_plan(LAYOUT, [8], generation=g) for g in (1, 2)]
POLL_S = 0.05


def config():
    return load_config(
        ROOT / "configs/gpt2-tiny.yaml",
        [
            "data.seq_len=16",
            "training.global_batch_size=16",
            "training.microbatch_size=2",
            f"training.steps={STEPS}",
            "training.optimizer.eps=1e-6",  # as tests/worlds/test_engine.py: noise-level gradients stay noise
        ],
    )


class _Held:
    """A trainer's fault injector whose `check` at step 1 (where injected faults sleep as a step
    starts, engine/resilience/faults.py) holds the step thread until `release` is set."""

    def __init__(self, faults: object) -> None:
        self.faults, self.held, self.release = faults, threading.Event(), threading.Event()

    def check(self, *, rank: int, step: int) -> None:
        if step == 1 and not self.held.is_set():
            self.held.set()
            self.release.wait()
        self.faults.check(rank=rank, step=step)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.faults, name)


def _hold_step_1(trainer: Trainer) -> tuple[threading.Event, threading.Event]:
    """(held, release): the trainer's step thread is held as it starts step 1 until `release` is set."""
    held = _Held(trainer.faults)
    trainer.faults = held  # type: ignore[assignment]
    return held.held, held.release


def _step_1(trainer: Trainer, ended: list) -> Callable[[], object]:
    """Step 1 handed over as the worker does (its epoch taken now); how it ended goes to `ended`."""
    epoch = trainer.applier.epoch

    def run() -> object:
        try:
            return trainer.train_step(1, epoch=epoch)
        except BaseException as err:
            ended.append(err)
            raise

    return run


def _run(runner: StepRunner, trainer: Trainer, step: int, should_abandon=lambda: None, fn=None):
    """One step in the runner's thread, handed over as the worker does (its epoch taken now)."""
    fn = fn or functools.partial(trainer.train_step, step, epoch=trainer.applier.epoch)
    return runner.run(fn, should_abandon=should_abandon, interval_s=POLL_S)


def _worker(rank: int, world: int, tmp: str, cfg_dict: dict) -> None:
    out: dict = {}
    try:
        _steps(rank, world, tmp, from_dict(cfg_dict), out)
    except BaseException:  # noqa: BLE001 - reported to the test; the process must not hang at exit
        out["error"] = traceback.format_exc()
    torch.save(out, os.path.join(tmp, f"rank{rank}.pt"))
    os._exit(0)  # an abandoned step's thread may still be blocked in gloo (engine/runner.py)


def _steps(rank: int, world: int, tmp: str, cfg, out: dict) -> None:
    torch.set_num_threads(1)
    sync = dist.FileStore(os.path.join(tmp, "sync"), world)
    trainer = Trainer(cfg, dataset=RandomTokens(), plan=PLANS[0], rank=rank, store=dist.FileStore(f"{tmp}/s1", world))
    runner = StepRunner()
    began = time.monotonic()
    _run(runner, trainer, 0)
    step_s = time.monotonic() - began
    ended: list = []
    if rank == 0:
        held, release = _hold_step_1(trainer)
    ready = held.is_set if rank == 0 else trainer.progress.waits_for_a_peer  # rank 1 waits for rank 0
    with pytest.raises(StepAbandoned):
        _run(runner, trainer, 1, should_abandon=lambda: "abandoned" if ready() else None, fn=_step_1(trainer, ended))
    stale = abandoned_threads()
    trainer.abort(abandoned=True)
    trainer.enter_generation(PLANS[1], dist.FileStore(f"{tmp}/s2", world))
    if rank == 0:
        release.set()
        stale[0].join(10 * step_s)  # it ends at once; running a step on generation 2 it would wait for rank 1
        out["stale_alive"] = stale[0].is_alive()
        out["stale_ended"] = repr(ended[0]) if ended else None
        out["stale_abandoned"] = bool(ended) and isinstance(ended[0], StepAbandoned)
        sync.set("stale", "alive" if out["stale_alive"] else "ended")
        if out["stale_alive"]:
            return
    elif sync.get("stale") == b"alive":
        return
    for step in range(1, STEPS):
        _run(runner, trainer, step)
    out["layers"] = {
        f"{i}:{n}": t for i, layer in trainer.checkpoint_state.layer_state().items() for n, t in layer.items()
    }


def test_an_abandoned_step_thread_that_wakes_up_late_touches_nothing_of_the_next_generation(tmp_path: Path) -> None:
    cfg = config()
    ranks.spawn(_worker, args=(2, str(tmp_path), to_dict(cfg)), nprocs=2)
    outs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for rank, out in enumerate(outs):
        assert "error" not in out, f"rank {rank}: {out['error']}"
    assert not outs[0]["stale_alive"], "the abandoned step's thread ran a step on the next generation's pipeline"
    assert outs[0]["stale_abandoned"], outs[0]["stale_ended"]
    ref = helpers.reference_state(cfg, RandomTokens(), STEPS)
    merged = {**outs[0]["layers"], **outs[1]["layers"]}
    assert set(merged) == set(ref)
    for key, t in merged.items():
        torch.testing.assert_close(t, ref[key], rtol=1e-5, atol=1e-6, msg=key)


def test_a_one_stage_step_thread_that_wakes_up_late_runs_nothing_on_the_next_generation() -> None:
    cfg = config()
    one = [layout_plan([[(0, 6)]], [8], generation=g) for g in (1, 2)]
    trainer = Trainer(cfg, dataset=RandomTokens(), plan=one[0], rank=0, store=dist.HashStore())
    try:
        runner = StepRunner()
        _run(runner, trainer, 0)
        held, release = _hold_step_1(trainer)
        ended: list = []
        with pytest.raises(StepAbandoned):
            _run(
                runner,
                trainer,
                1,
                should_abandon=lambda: "abandoned" if held.is_set() else None,
                fn=_step_1(trainer, ended),
            )
        (stale,) = abandoned_threads()
        trainer.abort(abandoned=True)
        trainer.enter_generation(one[1], dist.HashStore())
        release.set()
        stale.join()  # it ends either way: its own world of one answers every collective
        assert ended and isinstance(ended[0], StepAbandoned), ended
        touched = [n for n, p in trainer.layer_model.stage(0, 6).named_parameters() if p.grad is not None]
        assert not touched, f"the abandoned step ran a backward on the next generation's layers: {touched[:3]}"
        for step in range(1, STEPS):
            _run(runner, trainer, step)
        got = {f"{i}:{n}": t for i, layer in trainer.checkpoint_state.layer_state().items() for n, t in layer.items()}
    finally:
        trainer.close()
    ref = helpers.reference_state(cfg, RandomTokens(), STEPS)
    assert set(got) == set(ref)
    for key, t in got.items():
        torch.testing.assert_close(t, ref[key], rtol=1e-5, atol=1e-6, msg=key)
