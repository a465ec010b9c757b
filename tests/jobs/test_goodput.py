"""The goodput ledger (engine/telemetry/goodput.py): its rules on made-up timelines, `oobleck goodput` on
etcd values, the single process's TensorBoard scalars with the step guard exercised, and a job
with a kill, a join and a drain whose ledger sums to its wall time and whose every category
matches what the job's JSON event lines measured independently (`witness`)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from oobleck_elastic import cli
from oobleck_elastic.records.goodput import Category, Ledger, Origin, continue_from, describe, job_origin, opening
from oobleck_elastic.engine.telemetry.goodput import GoodputClock
from goodput_witness import Witness, witness
from helpers import tensorboard_run

ROOT = Path(__file__).resolve().parents[2]
U, R, S, RC, CK, W, SU = (
    Category.USEFUL,
    Category.REPLAYED,
    Category.SKIPPED,
    Category.RECONFIGURATION,
    Category.CHECKPOINTING,
    Category.WAITING,
    Category.STARTUP,
)


class FakeTime:
    """A wall clock the test sets."""

    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def seconds(ledger: Ledger) -> dict[Category, float]:
    return {c: round(ledger.get(c), 6) for c in Category if ledger.get(c)}


class Reports:
    """A ControlPlane.report_progress that keeps what it was sent, and a Metrics stand-in."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.scalars: list[tuple[dict, float, int, bool]] = []

    def __call__(self, **fields) -> None:
        self.sent.append(fields)

    def goodput(self, values: dict, fraction: float, *, step: int, final: bool = False) -> None:
        self.scalars.append((values, fraction, step, final))

    def last(self) -> Ledger:
        return Ledger.from_json(self.sent[-1]["goodput"])


def test_a_timeline_with_a_replay_a_skip_a_checkpoint_a_failure_a_new_rank_0_and_a_join() -> None:
    """Worker A holds rank 0 in generation 1 and dies in step 3; worker B holds it from generation 2
    on, through a join. Every interval lands in one category; the sum is the time from the start."""
    t = FakeTime(1012.0)
    a, reports = GoodputClock("node0", t), Reports()
    a.entered(1, 0, rank0=True, origin=lambda: Origin(reported=None, start=1000.0, first_plan=1010.0))

    def step(
        clock: GoodputClock, index: int, begin: float, end: float, outcome: Category, *, report_at=None, checkpoint=None
    ) -> None:
        t.t = begin
        clock.began_step()
        t.t = end
        clock.ended_step(index, outcome)
        if report_at is not None:
            t.t = report_at
            clock.reporter(reports, reports)(generation=1, step=index + 1)
        if checkpoint is not None:
            t.t = checkpoint[0]
            with clock.checkpointing():
                t.t = checkpoint[1]

    step(a, 0, 1013.0, 1014.0, U, report_at=1014.25)
    step(a, 1, 1014.5, 1015.5, R)  # the step guard rejects it: replayed
    step(a, 1, 1015.625, 1016.625, S, checkpoint=(1016.625, 1018.625))  # rejected again: skipped, then a checkpoint
    step(a, 2, 1018.75, 1019.75, U, report_at=1019.75)
    assert seconds(reports.last()) == {W: 10, SU: 3, U: 2.75, R: 1, S: 1, CK: 2}
    assert reports.last().done == 3
    # at the step the report (and the progress line) names: 3 steps done
    assert reports.scalars[-1] == ({c.value: reports.last().get(c) for c in Category}, 2.75 / 19.75, 3, False)
    t.t = 1020.0
    a.began_step()  # step 3 begins; node A dies in it

    t.t = 1025.0  # B enters generation 2 as rank 0 and continues from the last report
    b = GoodputClock("node0", t)
    b.entered(2, 3, rank0=True, origin=lambda: Origin(reported=reports.last()))
    step(b, 3, 1026.0, 1027.0, U, report_at=1027.0)
    assert seconds(reports.last()) == {W: 10, SU: 3, U: 3.75, R: 1, S: 1, CK: 2, RC: 6.25}

    t.t = 1030.0  # a join at the step boundary: B stays rank 0 and keeps its own ledger
    b.entered(3, 4, rank0=True, origin=lambda: Origin(reported=reports.last()))
    step(b, 4, 1031.0, 1032.0, U)
    t.t = 1032.0
    with b.checkpointing():  # the final checkpoint
        t.t = 1033.0
    t.t = 1033.5
    b.finished(reports, reports, generation=3, step=5)
    final = reports.last()
    assert seconds(final) == {W: 10, SU: 3, U: 5.25, R: 1, S: 1, CK: 3, RC: 10.25}
    assert final.total == pytest.approx(final.at - 1000.0) and final.at == 1033.5 and final.done == 5
    assert reports.sent[-1]["step"] == 5 and reports.scalars[-1][2:] == (5, True)  # the final point, at the last step


def test_a_worker_not_holding_rank_0_keeps_no_ledger_and_reports_none() -> None:
    clock, reports = GoodputClock("node0", FakeTime(5.0)), Reports()
    clock.entered(1, 0, rank0=False, origin=lambda: pytest.fail("read only by rank 0"))
    clock.began_step()
    clock.ended_step(0, U)
    clock.reporter(reports, reports)(generation=1, step=1)
    assert clock.ledger is None and reports.sent == [{"generation": 1, "step": 1}] and reports.scalars == []


def test_continuing_picks_the_newest_ledger() -> None:
    own = Ledger(start=0.0, at=50.0, seconds={"useful": 50.0}, open=U, done=5)
    older = Ledger(start=0.0, at=40.0, seconds={"useful": 40.0}, done=4)
    newer = Ledger(start=0.0, at=70.0, seconds={"useful": 60.0, "reconfiguration": 10.0}, done=7)
    # own is newest (its last report may still be on its way): the time since is reconfiguration
    kept = continue_from(own, Origin(reported=older), now=55.0)
    assert kept.at == 50.0 and kept.open is RC and kept.done == 5
    # somebody else held rank 0 meanwhile (this worker was a spare) and reported later
    assert continue_from(own, Origin(reported=newer), now=80.0) == Ledger(
        start=0.0, at=70.0, seconds={"useful": 60.0, "reconfiguration": 10.0}, open=RC, done=7
    )
    # nothing reported yet: open at the job's start; a failure before the first step stays startup
    fresh = continue_from(None, Origin(reported=None, start=10.0, first_plan=12.5), now=20.0)
    assert fresh == Ledger(start=10.0, at=12.5, seconds={"waiting": 2.5}, open=SU, done=0)
    assert continue_from(fresh, Origin(reported=None), now=30.0).open is SU
    assert opening(10.0, None) == Ledger(start=10.0, at=10.0, seconds={}, open=SU)


def test_a_step_run_again_after_a_checkpoint_restore_is_replayed_and_the_clock_never_runs_back() -> None:
    t = FakeTime(100.0)
    clock = GoodputClock("node0", t)
    # a reported ledger from a host whose clock is 3 s ahead: no negative interval
    ahead = Ledger(start=0.0, at=103.0, seconds={"useful": 103.0}, done=8)
    clock.entered(2, 6, rank0=True, origin=lambda: Origin(reported=ahead))
    t.t = 101.0
    clock.began_step()  # step 6 again: the job restored the checkpoint of step 6
    t.t = 104.0
    clock.ended_step(6, U)
    assert seconds(clock.ledger) == {U: 103.0, R: 1.0} and clock.ledger.done == 8


def test_reported_ledgers_are_validated() -> None:
    good = Ledger(start=1.0, at=4.0, seconds={"useful": 2.0, "checkpointing": 1.0}, done=2)
    back = Ledger.from_json(json.loads(json.dumps(good.to_json())))
    assert back == Ledger(start=1.0, at=4.0, seconds={c.value: good.get(c) for c in Category}, open=RC, done=2)
    for bad, message in [
        ({"start": 1.0}, r"not a goodput ledger \(KeyError: 'at'\)"),
        ({**good.to_json(), "seconds": {"coffee": 1.0}}, r"unknown or negative .* \['coffee'\]"),
        ({**good.to_json(), "seconds": {"useful": -1.0}}, r"unknown or negative .* \['useful'\]"),
        ({**good.to_json(), "done": "2"}, r"done '2' must be an integer"),
        ({**good.to_json(), "at": 0.5}, r"at 0.5 before start 1.0"),
        ("ledger", "not a goodput ledger"),
    ]:
        with pytest.raises(ValueError, match=message):
            Ledger.from_json(bad)


def test_an_unreadable_origin_is_logged_and_the_ledger_goes_on(caplog) -> None:
    clock = GoodputClock("node0", FakeTime(9.0))

    def broken() -> Origin:
        raise OSError("etcd out of reach")

    with caplog.at_level(logging.WARNING):
        clock.entered(2, 6, rank0=True, origin=broken)
    assert clock.ledger == Ledger(start=9.0, at=9.0, seconds={}, open=SU)
    assert (
        "gen 2 step 6 node node0: goodput ledger: could not read where it stands (etcd out of reach); "
        "continuing from now, as if the job started here"
    ) in caplog.text


def test_job_origin_and_describe() -> None:
    assert job_origin([(5.0, "join", None), (3.0, "join", None), (7.0, "plan", 1), (9.0, "plan", 2)]) == (3.0, 7.0)
    assert job_origin([]) == (None, None)
    ledger = Ledger(start=0.0, at=99.0, seconds={"useful": 60.0, "reconfiguration": 30.0, "waiting": 9.0}, done=12)
    lines = describe(ledger, start=0.0, end=100.0, closed=True)
    assert lines[0].startswith("wall time 100.00 s, from the job's start ")
    assert lines[1].split()[:4] == ["useful", "60.00", "s", "60.0"]
    assert lines[5].split()[:4] == ["reconfiguration", "30.00", "s", "30.0"]
    assert lines[-2].split()[:4] == ["sum", "99.00", "s", "99.0"] and "1.00 s before the close" in lines[-2]
    assert lines[-1] == "goodput: 60.6 % of the time accounted went to useful steps (12 step(s) completed)"
    running = describe(ledger, start=0.0, end=105.0, closed=False)
    assert " to now (running) " in running[0] and "6.00 s before the time of reading" in running[-2]


def _run_keys(client, keys, *, ledger: Ledger | None, closed_at: float | None) -> None:
    from oobleck_elastic.records.job import ClosedRecord, Event, EventKind
    from oobleck_elastic.rendezvous.membership import put_event

    put_event(client, keys, Event(time=1000.0, kind=EventKind.JOIN, node="node0", detail="host h"))
    put_event(client, keys, Event(time=1004.0, kind=EventKind.PLAN, node="node0", generation=1))
    progress = {"generation": 1, "step": 3, "time": 1020.0, "node": "node0"}
    client.put_json(keys.progress, progress | ({"goodput": ledger.to_json()} if ledger else {}))
    if closed_at is not None:
        client.put_json(keys.closed, ClosedRecord(time=closed_at, reason="finished 3 steps").to_json())


def test_the_goodput_command(etcd_server, run_id, capsys) -> None:
    from oobleck_elastic.etcd import EtcdSettings, connect
    from oobleck_elastic.records.keys import Keys

    keys = Keys("/oobleck", run_id)
    client = connect(EtcdSettings(endpoint=etcd_server.endpoint))
    ledger = Ledger(
        start=1000.0, at=1020.0, done=3, seconds={"waiting": 4.0, "startup": 2.0, "useful": 10.0, "checkpointing": 4.0}
    )
    try:
        _run_keys(client, keys, ledger=ledger, closed_at=1020.5)
    finally:
        client.close()
    base = ["--endpoint", etcd_server.endpoint, "--run-id", run_id]
    assert cli.main(["goodput", *base]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"run {run_id} (closed: finished 3 steps): wall time 20.50 s, from the job's start")
    assert [line.split()[:2] for line in lines[1:10]] == [
        ["useful", "10.00"],
        ["replayed", "0.00"],
        ["skipped", "0.00"],
        ["shadows", "0.00"],
        ["reconfiguration", "0.00"],
        ["checkpointing", "4.00"],
        ["waiting", "4.00"],
        ["startup", "2.00"],
        ["sum", "20.00"],
    ]
    assert "0.50 s before the close" in lines[9]
    assert lines[10] == "goodput: 50.0 % of the time accounted went to useful steps (3 step(s) completed)"
    assert cli.main(["goodput", "--json", *base]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["wall_s"], data["accounted_s"], data["fraction"], data["closed"]) == (20.5, 20.0, 0.5, True)
    assert data["seconds"] == {
        "useful": 10.0,
        "replayed": 0.0,
        "skipped": 0.0,
        "shadows": 0.0,
        "reconfiguration": 0.0,
        "checkpointing": 4.0,
        "waiting": 4.0,
        "startup": 2.0,
    }


def test_the_goodput_command_says_what_is_wrong_in_one_line(etcd_server, run_id, capsys) -> None:
    from oobleck_elastic.etcd import EtcdSettings, connect
    from oobleck_elastic.records.keys import Keys

    assert cli.main(["goodput", "--endpoint", etcd_server.endpoint, "--run-id", "no-such-run"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"oobleck goodput: error: run 'no-such-run' not found at {etcd_server.endpoint} (no keys under "
        "/oobleck/no-such-run/): check --run-id and --key-prefix\n"
    )
    client = connect(EtcdSettings(endpoint=etcd_server.endpoint))
    try:
        _run_keys(client, Keys("/oobleck", run_id), ledger=None, closed_at=None)
    finally:
        client.close()
    assert cli.main(["goodput", "--endpoint", etcd_server.endpoint, "--run-id", run_id]) == 2
    assert capsys.readouterr().err == (
        f"oobleck goodput: error: run '{run_id}' has no goodput ledger yet: it is "
        "reported with the progress of the first step\n"
    )


def _final_scalars(tb_dir: Path) -> tuple[dict[str, float], int]:
    ea = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    ea.Reload()
    # the newest point of each tag: several rank-0 writers' files are read in name order, which is
    # not their order when two were created in the same second (the names start with the second)
    last = {
        tag.removeprefix("goodput/"): max(ea.Scalars(tag), key=lambda e: (e.step, e.wall_time))
        for tag in ea.Tags()["scalars"]
        if tag.startswith("goodput/")
    }
    assert len({e.step for e in last.values()}) == 1, last
    return {k: e.value for k, e in last.items()}, next(iter(last.values())).step


def test_the_single_process_ledger_shows_the_step_guard_and_checkpoints(tmp_path: Path, monkeypatch, caplog) -> None:
    """Step 4 is NaN twice (OOBLECK_NAN_AT, engine/resilience/faults.py): one run replayed, one skipped; a
    checkpoint every 2 steps. TensorBoard has the ledger at every step and the final one; its
    categories match what the event lines measured (`witness`; tolerances: see EPS)."""
    from oobleck_elastic.config import load_config
    from oobleck_elastic.engine.run import train
    from oobleck_elastic.logs import EventLines, read_event_lines

    cfg = load_config(
        ROOT / "configs/gpt2-tiny.yaml",
        [
            "data.seq_len=16",
            "training.global_batch_size=8",
            "training.microbatch_size=2",
            "training.steps=6",
            f"checkpoint.dir={tmp_path / 'ckpt'}",
            "checkpoint.interval_steps=2",
            f"logging.tensorboard_dir={tmp_path / 'runs'}",
            f"data.cache_dir={tmp_path / 'cache'}",
            f"logging.events_dir={tmp_path / 'events'}",
        ],
    )
    monkeypatch.setenv("OOBLECK_NAN_AT", "0@3x2")
    caplog.set_level(logging.INFO, logger="oobleck_elastic")  # the `step` and `checkpoint` lines are INFO
    began = time.time()
    try:
        summary = train(cfg)
    finally:  # this process's event lines go to this test's directory only
        root = logging.getLogger("oobleck_elastic")
        for h in [h for h in root.handlers if isinstance(h, EventLines) and tmp_path in h.path.parents]:
            root.removeHandler(h)
            h.close()
    wall = time.time() - began
    assert summary.not_applied == ("step 4: the loss is nan; replayed", "step 4: the loss is nan; batch skipped")
    final, step = _final_scalars(tensorboard_run(tmp_path / "runs"))
    assert step == 6 and set(final) == {c.value for c in Category} | {"fraction"}
    assert final["replayed"] > 0 and final["skipped"] > 0 and final["checkpointing"] > 0 and final["startup"] > 0
    assert final["reconfiguration"] == 0 and final["waiting"] < 0.1  # a fixed microbatch size: nothing to plan
    accounted = sum(v for k, v in final.items() if k != "fraction")
    assert final["fraction"] == pytest.approx(final["useful"] / accounted, rel=1e-5)
    assert 0 < accounted <= wall  # from the LocalControl's start to the final report, inside train()
    w = witness(read_event_lines(tmp_path / "events"), steps=6)
    n, said = w.counts, (w, final)
    assert (n["applied"], n["again"], n["replayed"], n["skipped"], n["checkpoints"], n["changes"]) == (5, 0, 1, 1, 3, 0)
    assert abs(final["checkpointing"] - w.checkpoints) <= CHECKPOINT_EPS * n["checkpoints"], said
    assert abs(final["replayed"] - w.rejected) <= EPS and abs(final["skipped"] - w.skipped) <= EPS, said
    assert w.applied - EPS <= final["useful"] <= w.applied + BOOKKEEPING * n["applied"], said
    span = w.last_line - w.first_step  # from the first step's start to the final checkpoint's line
    assert abs(final["useful"] + final["replayed"] + final["skipped"] + final["checkpointing"] - span) <= EPS, said


def test_the_witness_reads_each_category_from_the_event_lines() -> None:
    """A made-up job: node0 holds rank 0 in generation 1 (steps 1-2, step 3 replayed then skipped,
    step 4, a checkpoint it never reported) and is killed; node2 holds it in generation 2 (a
    retake, step 5, a save skipped for want of room, step 6, step 5 run again, the final checkpoint)."""

    def line(t: float, event: str, gen: int, step: int, node: str, **fields) -> dict:
        return {"t": t, "event": event, "gen": gen, "step": step, "node": node, **fields}

    events = [
        line(10.0, "entered", 1, 0, "node0", rank=0, seconds=2.0),
        line(10.0, "entered", 1, 0, "node1", rank=1, seconds=2.0),
        line(11.0, "step", 1, 1, "node0", seconds=1.0),
        line(12.0, "step", 1, 2, "node0", seconds=1.0),
        line(12.5, "replayed", 1, 2, "node1", seconds=0.5),  # not rank 0's: not counted
        line(12.5, "replayed", 1, 2, "node0", seconds=0.5),
        line(13.0, "skipped", 1, 2, "node0", seconds=0.5),
        line(14.0, "step", 1, 4, "node0", seconds=1.0),
        line(14.5, "checkpoint", 1, 4, "node0", seconds=0.5),  # node0 reported no more
        line(20.0, "entered", 2, 4, "node2", rank=0, seconds=3.0),
        line(20.25, "checkpoint", 2, 4, "node2", seconds=0.25),  # the retake
        line(21.0, "step", 2, 5, "node2", seconds=0.75),
        line(21.125, "checkpoint_skipped", 2, 5, "node2", seconds=0.125),  # its look for room
        line(22.0, "step", 2, 6, "node2", seconds=1.0),
        line(23.0, "step", 2, 5, "node2", seconds=1.0),  # the same step again (made up)
        line(23.5, "checkpoint", 2, 6, "node2", seconds=0.5),  # the final one
    ]
    w = witness(events, steps=6, killed=("node0",))
    assert w == Witness(
        applied=1.0 + 1.0 + 1.0 + 0.75 + 1.0,
        again=1.0,
        rejected=0.5,
        skipped=0.5,
        checkpoints=0.25 + 0.125 + 0.5,
        gaps=(21.0 - 0.75) - 14.0 - 0.25,  # node0's step 4 ends, node2's step 5 begins; less the retake
        entries=3.0,
        first_step=10.0,
        last_line=23.5,
        killed_last=1.0,
        counts={"applied": 5, "again": 1, "replayed": 1, "skipped": 1, "checkpoints": 3, "changes": 1},
    )


# Tolerances. The ledger's clock (`time.time` in GoodputClock) and a line's own measurement (a
# `seconds` on `time.perf_counter`, or its `t`) are read a few calls apart at both ends of each
# thing timed: a thread hand-off for a step, a log call, a dozen TensorBoard scalars queued. On
# the shared 2-core machine (load average 3 to 250) that came to 1-13 ms per thing (a step run, a
# checkpoint, a generation change, the span); EPS allows 40 ms per thing, less than one rejected
# run (60 ms or more), so a run charged to another category fails. A checkpoint's ends have no
# thread hand-off (1-3 ms measured): CHECKPOINT_EPS allows 20 ms each, a third of the job's 5-6
# checkpoints together (0.4-1.4 s), so they cannot go to another category unseen (one short one
# alone may). BOOKKEEPING bounds what `useful` adds to an applied step's own time (the progress
# report: an etcd put and get; TensorBoard; the log line): 4-11 ms a step there, 50 ms allowed.
EPS, CHECKPOINT_EPS, BOOKKEEPING = 0.04, 0.02, 0.05


def _cross_check(
    ledger: Ledger, events: list[dict], *, steps: int, skipped: int, killed: str, first_plan: float, keep: Path
) -> None:
    """Each category of the job's final ledger against what its event lines measured (`Witness`).
    A killed rank 0 may have written its last step's line and died before reporting it: then the
    ledger charges that step to `reconfiguration`, not `useful` (`w.killed_last`, one way only). Or
    it synced the next step and died before writing its line: the survivors applied that step, and
    both the ledger and the witness count it in the gap between the generations."""
    w = witness(events, steps=steps, killed=(killed,))
    got, n = {c: ledger.get(c) for c in Category}, w.counts
    said = f"{w}\nledger {ledger.to_json()['seconds']}"
    keep.write_text(said + "\n")  # kept for a post-mortem
    lines = {e["step"] for e in events if e["event"] == "step"}
    # every step applied has its line, but the one the survivors applied after the killed rank 0's
    # last line: it took part in that step's gradient sync and died before writing its line
    last = max((e["step"] for e in events if e["event"] == "step" and e["node"] == killed), default=0)
    missing = set(range(1, steps + 1)) - {skipped + 1} - lines
    assert lines <= set(range(1, steps + 1)) and missing <= {last + 1}, said
    assert n["replayed"] == n["skipped"] == 1 and n["changes"] >= 3 and n["checkpoints"] >= 5, said
    assert abs(got[CK] - w.checkpoints) <= CHECKPOINT_EPS * n["checkpoints"], said
    assert abs(got[S] - w.skipped) <= EPS * n["skipped"], said
    assert abs(got[R] - w.rejected - w.again) <= EPS * (n["replayed"] + n["again"]), said
    # reconfiguration: the gaps between generations, which hold each new rank 0's entry
    assert w.gaps - EPS * n["changes"] <= got[RC] <= w.gaps + w.killed_last + EPS * n["changes"], said
    assert got[RC] >= w.entries > 0, said
    # useful: the applied steps' own times (the ledger's window holds each), plus their bookkeeping
    assert w.applied - w.killed_last - EPS <= got[U] <= w.applied + BOOKKEEPING * n["applied"], said
    # from the first plan (etcd) to the first step's start (its line); from there to the final
    # checkpoint's line (just before the last report) the other five categories share the time. The
    # ledger's boundary is where the worker hands the first step to its step thread, before the
    # step's own clock starts: that hand-over, which load stretches (48 ms seen), is bookkeeping
    handover = (w.first_step - first_plan) - got[SU]
    assert -EPS <= handover <= EPS + BOOKKEEPING, said
    span = w.last_line - w.first_step
    assert -EPS <= got[U] + got[R] + got[S] + got[RC] + got[CK] - span <= EPS + BOOKKEEPING, said


@pytest.mark.slow
def test_a_job_with_a_kill_a_join_and_a_drain_accounts_for_its_wall_time(
    tmp_path: Path, etcd_server, run_id, capsys
) -> None:
    """Four nodes; step 3 is NaN twice on rank 0 (replayed, then skipped); a checkpoint every 10
    steps; the node holding rank 0 is SIGKILLed once 4 steps are done (another worker holds rank 0
    and continues the ledger); a fifth node, started once 5 are done, joins; then a node is drained.
    The ledger's categories sum to the wall time from the job's first event to its `closed`
    record, measured here, within 2 % (which holds by construction), and each category matches
    what the job's JSON event lines measured where it happened (`_cross_check`): the steps' own
    times, the rejected runs', the checkpoints', the gaps between generations, the first step's
    start. The sample ledger (records/samples.py) proves every sample used exactly once, the
    skipped batch aside."""
    from launcher.faults import kill_node
    from oobleck_elastic import cluster_ops
    from oobleck_elastic.logs import read_event_lines
    from oobleck_elastic.etcd import EtcdSettings, connect
    from oobleck_elastic.planning import Plan
    from oobleck_elastic.records.keys import Keys
    from oobleck_elastic.records.read import read_closed
    from oobleck_elastic.rendezvous.membership import live_nodes, read_events
    from helpers import paced, run_job, tiny_profile, when

    keys, steps = Keys("/oobleck", run_id), 40
    killed, drained = [], []

    def plan(c) -> Plan:
        return Plan.from_json(c.get_json(keys.plan)[0])

    def progress(c) -> dict:
        return c.get_json(keys.progress)[0] or {}

    def rank0(p: Plan) -> str:
        return p.stage_of(0)[1].node

    def kill_rank0(c) -> None:
        killed.append(rank0(plan(c)))
        kill_node(next(r.agent_pid for r in live_nodes(c, keys) if r.node_id == killed[0]))

    def joined_and_trained(c) -> bool:  # the joiner (node4) trains in the current generation
        p = plan(c)
        return "node4" in p.nodes and progress(c).get("generation", 0) >= p.generation

    def drain(c) -> None:
        p, leader = plan(c), (c.get_json(keys.leader)[0] or {}).get("node_id")
        node = next(n for n in [rank0(p), *p.nodes] if n not in (leader, "node4"))
        drained.append(node)
        cluster_ops.kill_agent(c, keys, next(r.index for r in live_nodes(c, keys) if r.node_id == node))

    def during(proc) -> None:
        when(etcd_server.endpoint, proc, lambda c: progress(c).get("step", 0) >= 4, kill_rank0)
        when(etcd_server.endpoint, proc, joined_and_trained, drain)

    out, _, _ = run_job(
        tmp_path,
        etcd_server,
        run_id,
        ["--nodes", "4", "--join", "5"],
        steps,
        tiny_profile(tmp_path / "profile.json"),
        extra=["checkpoint.interval_steps=10", f"logging.events_dir={tmp_path / 'events'}"],
        during=during,
        killed_by_test=1,
        reference=False,
        env={"OOBLECK_NAN_AT": "0@2x2", **paced(5, steps, 2.0)},  # 70 s for the join and the drain
    )
    assert len(killed) == 1 and len(drained) == 1, out[-4000:]
    assert f"node {drained[0]} was drained" in out and "(join: +node4)" in out, out[-4000:]
    client = connect(EtcdSettings(endpoint=etcd_server.endpoint))
    try:
        ledger = Ledger.from_json(client.get_json(keys.progress)[0]["goodput"])
        closed = read_closed(client, keys)
        start = min(e.time for _, e in read_events(client, keys))
        first_plan = min(e.time for _, e in read_events(client, keys) if e.kind == "plan")
        holders = {rank0(Plan.from_json(v)) for _, v in client.get_prefix_json(keys.plans)}
    finally:
        client.close()
    assert closed is not None and closed.reason == f"finished {steps} steps"
    wall = closed.time - start
    assert abs(ledger.total - wall) <= 0.02 * wall, (ledger.total, wall, ledger.seconds)  # by construction
    # each category against the job's event lines, which the ledger is not computed from
    events = read_event_lines(tmp_path / "events")
    keep = tmp_path / "witness.txt"
    _cross_check(ledger, events, steps=steps, skipped=2, killed=killed[0], first_plan=first_plan, keep=keep)
    assert len(holders) >= 2 and killed[0] in holders  # rank 0 changed hands: the ledger was continued
    for c in Category:  # every category was exercised (the job keeps no shadow copies)
        assert ledger.get(c) > 0 or c is Category.SHADOWS, (c, ledger.seconds)
    assert ledger.get(Category.SHADOWS) == 0
    assert ledger.done == steps
    # TensorBoard's final point is the same ledger
    final, at = _final_scalars(tensorboard_run(tmp_path / "job" / "runs"))
    assert at == steps and final["fraction"] == pytest.approx(ledger.fraction, rel=1e-5)
    for c in Category:
        assert final[c.value] == pytest.approx(ledger.get(c), rel=1e-5, abs=1e-3)
    assert cli.main(["goodput", "--endpoint", etcd_server.endpoint, "--run-id", run_id]) == 0
    lines = capsys.readouterr().out.splitlines()
    (tmp_path / "goodput.txt").write_text("\n".join(lines) + "\n")  # kept for a post-mortem
    assert lines[0].startswith(f"run {run_id} (closed: finished {steps} steps): wall time {wall:.2f} s")
    assert lines[9].split()[:2] == ["sum", f"{ledger.total:.2f}"]
    # every sample exactly once through the kill (a roll-forward or a replay), the join and the drain
    assert cli.main(["samples", "--check", "--events-dir", str(tmp_path / "events")]) == 0
    lines = capsys.readouterr().out.splitlines()
    (tmp_path / "samples.txt").write_text("\n".join(lines) + "\n")
    assert lines[0].startswith(
        f"samples: exactly once: {steps - 1} of {steps} steps applied, 1 skipped by the step guard (step(s) 2); "
    ), lines
    generations = lines[0].rsplit("generations ", 1)[1]
    assert generations not in ("1", "none"), lines  # the steps were fed by several generations
