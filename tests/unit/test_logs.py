"""JobLog's `gen/step/node/rank` prefix and the JSON event lines (oobleck_elastic/logs.py)."""

from __future__ import annotations

import json
import logging

import pytest

from oobleck_elastic.logs import JobLog, attach_event_lines, clip, event_line, read_event_lines, where_prefix


@pytest.fixture
def logger():
    lg = logging.getLogger("oobleck_elastic.test_logs")
    lg.setLevel(logging.DEBUG)
    yield lg
    for h in list(lg.handlers):
        lg.removeHandler(h)
        h.close()


def test_prefix_names_what_is_known_in_the_vocabulary_order():
    assert where_prefix({"node": "n1", "gen": 3, "step": 12}) == "gen 3 step 12 node n1: "
    assert (
        where_prefix({"gen": 2, "step": 5, "total": 20, "node": "n0", "rank": 1}) == "gen 2 step 5/20 node n0 rank 1: "
    )
    assert where_prefix({"node": "n4"}) == "node n4: "
    assert where_prefix({"gen": None, "node": "n4"}) == "node n4: "
    assert where_prefix({}) == ""


def test_text_lines_carry_the_prefix(logger, caplog):
    log = JobLog(logger, node="n1")
    with caplog.at_level(logging.INFO, logger=logger.name):
        log.at(gen=3, step=7).warning("communication failed (%s); waiting for the next plan", "peer gone")
        log.info("leaving the job (%s)", "drained")
    assert [r.getMessage() for r in caplog.records] == [
        "gen 3 step 7 node n1: communication failed (peer gone); waiting for the next plan",
        "node n1: leaving the job (drained)",
    ]


def test_events_are_json_lines_and_plain_lines_are_not(logger, tmp_path):
    attach_event_lines(tmp_path / "ev", logger=logger.name)
    assert attach_event_lines(tmp_path / "ev", logger=logger.name) is not None
    assert len(logger.handlers) == 1, "attaching twice for the same file adds no second handler"
    log = JobLog(logger, node="n2")
    log.at(gen=1, step=4, total=9).info("loss %.2f", 1.5, event="step", fields={"loss": 1.5})
    log.at(gen=1).info("not an event")
    log.at(gen=2, step=4, rank=3).info("entered", event="entered", fields={"rolled_forward": True})
    (files,) = list((tmp_path / "ev").glob("events-*.jsonl"))
    raw = [json.loads(line) for line in files.read_text().splitlines()]
    assert [e["event"] for e in raw] == ["step", "entered"]
    step = raw[0]
    assert {k: step[k] for k in ("level", "gen", "step", "total", "node", "msg", "loss")} == {
        "level": "INFO",
        "gen": 1,
        "step": 4,
        "total": 9,
        "node": "n2",
        "msg": "loss 1.50",
        "loss": 1.5,
    }
    assert raw[1]["rank"] == 3 and raw[1]["rolled_forward"] is True
    # read back by kind, in time order; a torn last line (a killed writer) is skipped
    with files.open("a") as fh:
        fh.write('{"t": 1, "event": "st')
    assert [e["event"] for e in read_event_lines(tmp_path / "ev", ["entered"])] == ["entered"]
    assert len(read_event_lines(tmp_path / "ev")) == 2


def test_off_without_a_directory(logger):
    assert attach_event_lines("", logger=logger.name) is None
    assert logger.handlers == []


def test_event_line_writes_the_events_file_and_no_text_line(logger, tmp_path, caplog):
    assert event_line("samples", {"kind": "skipped"}, logger=logger.name, gen=1, step=2) is False  # no directory
    attach_event_lines(tmp_path / "ev", logger=logger.name)
    with caplog.at_level(logging.DEBUG, logger=logger.name):
        assert event_line("samples", {"kind": "skipped"}, logger=logger.name, gen=1, step=2, rank=0) is True
    assert caplog.records == []
    (line,) = read_event_lines(tmp_path / "ev")
    assert {k: v for k, v in line.items() if k != "t"} == {
        "level": "INFO",
        "event": "samples",
        "gen": 1,
        "step": 2,
        "rank": 0,
        "msg": "",
        "kind": "skipped",
    }


def test_clip_cuts_at_a_word_and_drops_a_source_location():
    gloo = (
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:19597: "
        "Connection reset by peer. This is typically caused by a remote worker crashing"
    )
    short = clip(gloo, 60)
    assert short == "Read error [127.0.0.1]:19597: Connection reset by peer…"
    assert len(short) <= 60 and clip("a whole line", 60) == "a whole line"
    assert clip("x" * 100, 10) == "x" * 9 + "…"  # no word to cut at
