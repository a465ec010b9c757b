"""The job's TensorBoard run (engine/telemetry/board.py, records/board.py), checked without a
browser: the run directory per start, agreed once per job in etcd; the step numbering against the
progress lines; the tags TensorBoard's tabs show, throughput first; the custom-scalars page as
TensorBoard's own custom-scalars plugin serves it from the event files; and the job-level
reconfiguration figures on made-up moves and votes. (The figures of a real reconfiguration:
tests/jobs/test_recovery.py.)"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from oobleck_elastic.config import load_config
from oobleck_elastic.engine.entry.reconfigure import Move
from oobleck_elastic.engine.run import train
from oobleck_elastic.engine.step.commit import CommitVote, combine, own_slot
from oobleck_elastic.engine.telemetry import board
from oobleck_elastic.engine.telemetry.board import LAYOUT, TAGS, JobFigures, layout_tags, run_name
from oobleck_elastic.etcd.memory import MemoryKV
from oobleck_elastic.records.board import BoardRecord, claim_board, read_board
from oobleck_elastic.records.goodput import Category
from oobleck_elastic.records.keys import Keys
from helpers import tensorboard_runs

ROOT = Path(__file__).resolve().parents[2]
KEYS = Keys("/oobleck", "job7")
NOON = 1_764_072_000.0  # 2025-11-25 12:00:00 UTC


# ---------------------------------------------------------------------------- the run directory
def test_a_run_is_named_by_its_run_id_and_utc_start_and_never_reuses_a_directory() -> None:
    assert run_name("job7", now=NOON) == "job7/20251125-120000"
    taken = {"job7/20251125-120000", "job7/20251125-120000-2"}
    assert run_name("job7", now=NOON, taken=taken.__contains__) == "job7/20251125-120000-3"
    with pytest.raises(ValueError, match="run id 'a/b' cannot name a TensorBoard directory: use a name without '/'"):
        run_name("a/b", now=NOON)


def test_the_first_writer_chooses_the_run_and_every_later_one_reads_it() -> None:
    kv = MemoryKV()
    assert claim_board(kv, KEYS, "job7/20251125-120000", node="node0") == "job7/20251125-120000"
    # rank 0 moved to another node: its own proposal (a later start time) loses to the job's run
    assert claim_board(kv, KEYS, "job7/20251125-120105", node="node2") == "job7/20251125-120000"
    found = read_board(kv, KEYS)
    assert found is not None and (found.run, found.node) == ("job7/20251125-120000", "node0")
    assert kv.get_json(KEYS.tensorboard)[0]["schema_version"] == 1
    assert KEYS.tensorboard == "/oobleck/job7/tensorboard"


def test_a_malformed_run_record_is_replaced_and_refused_by_readers() -> None:
    kv = MemoryKV()
    kv.put_json(KEYS.tensorboard, {"run": "../elsewhere", "node": "node0", "time": 1.0})
    assert read_board(kv, KEYS) is None
    assert claim_board(kv, KEYS, "job7/20251125-120000", node="node1") == "job7/20251125-120000"
    found = read_board(kv, KEYS)
    assert found is not None and (found.run, found.node) == ("job7/20251125-120000", "node1")
    for bad, why in (
        ({"run": "/abs", "node": "n", "time": 1}, "run '/abs' is not a relative directory name"),
        ({"run": "", "node": "n", "time": 1}, "run '' is not a relative directory name"),
        ({"run": "a/b", "node": 3, "time": 1}, "node 3 / time 1 are not a node id and a Unix time"),
        ([], "expected an object, got list"),
    ):
        with pytest.raises(ValueError, match=re.escape(why)):
            BoardRecord.parse(bad)


# ---------------------------------------------------------------------------- job-level figures
def test_the_job_figures_sum_every_move_and_span_every_workers_entry() -> None:
    moves = (
        Move(src="node3", dst="node2", layers=(3, 4), bytes=3_200_000),
        Move(src="node1", dst="node2", layers=(5,), bytes=1_600_000),
    )
    began, ended = [NOON + 0.5, NOON + 0.25, NOON + 1.0], [NOON + 2.0, NOON + 3.5, NOON + 2.75]

    def vote(rank: int) -> CommitVote:
        return CommitVote(
            generation=2,
            peak_rss_bytes=1,
            peak_device_bytes=None,
            max_loss=1.0,
            rejections=0,
            stop=0,
            entry_began=began[rank],
            entry_ended=ended[rank],
            compute_s=own_slot(rank, 3, 0.1),
        )

    agreed = combine([vote(r) for r in range(3)])  # what the first step's commit gives rank 0
    assert (agreed.entry_began, agreed.entry_ended) == (NOON + 0.25, NOON + 3.5)
    # rank 0 (on node0) moved nothing: the job moved 4.8 MB, and its last worker entered 3.25 s after the first began
    assert JobFigures.of(moves, (agreed.entry_began, agreed.entry_ended)) == JobFigures(4_800_000, 3.25)
    assert JobFigures.of((), (None, None)) == JobFigures(0, None)


# ---------------------------------------------------------------------------- what TensorBoard shows
def _tensorboard_compare(a: str, b: str) -> int:
    """TensorBoard 2.21's tag comparison (its frontend's `compareTagNames`): numbers compare by
    value, '/' and digits sort before anything else, other characters by code unit (so upper
    case before lower case). Numbers here are runs of digits only (the tags have no decimals)."""
    i = j = 0
    while True:
        if i == len(a):
            return 0 if j == len(b) else -1
        if j == len(b):
            return 1
        if a[i].isdigit() and b[j].isdigit():
            ei, ej = i, j
            while ei < len(a) and a[ei].isdigit():
                ei += 1
            while ej < len(b) and b[ej].isdigit():
                ej += 1
            x, y = int(a[i:ei]), int(b[j:ej])
            if x != y:
                return -1 if x < y else 1
            i, j = ei, ej
            continue
        brk_a, brk_b = a[i] == "/" or a[i].isdigit(), b[j] == "/" or b[j].isdigit()
        if brk_a and not brk_b:
            return -1
        if brk_b and not brk_a:
            return 1
        if not brk_a and a[i] != b[j]:
            return -1 if a[i] < b[j] else 1
        i, j = i + 1, j + 1


def tensorboard_groups(tags: list[str]) -> list[str]:
    """The order of the tag groups in TensorBoard's Time Series and Scalars tabs: tags sorted by
    its comparison, grouped by their first path element in order of appearance."""
    import functools

    groups: list[str] = []
    for tag in sorted(tags, key=functools.cmp_to_key(_tensorboard_compare)):
        if tag.split("/", 1)[0] not in groups:
            groups.append(tag.split("/", 1)[0])
    return groups


def test_throughput_sorts_first_in_tensorboard() -> None:
    documented = [t.replace("<node>", "node1") for t in TAGS]
    assert tensorboard_groups(documented)[0] == "Throughput"
    assert tensorboard_groups(["train/tokens_per_s", "cluster/nodes", "perf/mfu"]) == ["cluster", "perf", "train"]
    assert _tensorboard_compare("straggler/slowdown/node2", "straggler/slowdown/node10") == -1  # by value


def _plugin(logdir: Path):
    """TensorBoard's custom-scalars plugin over `logdir`, as `tensorboard --logdir` builds it."""
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.custom_scalar import custom_scalars_plugin
    from tensorboard.plugins.scalar import scalars_plugin

    multiplexer = plugin_event_multiplexer.EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(logdir))
    multiplexer.Reload()
    tb = base_plugin.TBContext(
        logdir=str(logdir),
        multiplexer=multiplexer,
        data_provider=data_provider.MultiplexerDataProvider(multiplexer, str(logdir)),
    )
    scalars = scalars_plugin.ScalarsPlugin(tb)
    tb.plugin_name_to_instance = {scalars.plugin_name: scalars}  # the custom-scalars plugin asks for it
    plugin = custom_scalars_plugin.CustomScalarsPlugin(tb)
    tb.plugin_name_to_instance[plugin.plugin_name] = plugin
    return plugin, multiplexer, context.RequestContext()


def _config(tmp: Path, steps: int) -> object:
    return load_config(
        ROOT / "configs/gpt2-tiny.yaml",
        [
            "data.seq_len=16",
            "training.global_batch_size=8",
            "training.microbatch_size=2",
            f"training.steps={steps}",
            f"checkpoint.dir={tmp / 'ckpt'}",
            "checkpoint.interval_steps=1",
            f"logging.tensorboard_dir={tmp / 'runs'}",
            f"data.cache_dir={tmp / 'cache'}",
        ],
    )


def test_two_starts_make_two_runs_laid_out_as_the_logs_count(tmp_path: Path, caplog) -> None:
    """The same job started twice (the second resumes from the first's checkpoint): two runs under
    `<tensorboard_dir>/gpt2-tiny/`, one event file each. In each, the custom-scalars page has the
    throughput, nodes and pipelines, memory and goodput charts and every chart's tags are written
    (as the plugin serves them to the browser); every scalar tag written is documented; steps
    are the progress lines' numbers."""
    caplog.set_level(logging.INFO, logger="oobleck_elastic.train")
    first = train(_config(tmp_path, 2))
    second = train(_config(tmp_path, 3))
    assert second.resumed_from == 2
    runs = tensorboard_runs(tmp_path / "runs")
    assert [str(r) for r in runs] == sorted([first.tensorboard, second.tensorboard]) and len(runs) == 2
    assert all(r.parent == tmp_path / "runs" / "gpt2-tiny" for r in runs)
    assert all(len(list(r.glob("events.out.tfevents.*"))) == 1 for r in runs)
    assert f"(open with: tensorboard --logdir {tmp_path / 'runs'}; one run per start)" in "\n".join(second.lines())
    printed = sorted({int(m.group(1)) for m in re.finditer(r"step (\d+)/[23] ", caplog.text)})
    assert printed == [1, 2, 3]

    plugin, multiplexer, ctx = _plugin(tmp_path / "runs")
    assert sorted(multiplexer.Runs()) == sorted(str(r.relative_to(tmp_path / "runs")) for r in runs)  # never merged
    a, b = (str(Path(s.tensorboard).relative_to(tmp_path / "runs")) for s in (first, second))
    events = {}
    for run in (a, b):
        ea = EventAccumulator(str(tmp_path / "runs" / run), size_guidance={"scalars": 0, "tensors": 0})
        events[run] = ea.Reload()

    def steps(run: str, tag: str) -> list[int]:
        return [e.step for e in events[run].Scalars(tag)]

    assert steps(a, "train/loss") == [1, 2] and steps(b, "train/loss") == [3]  # "step 3/3" is the rerun's
    assert steps(b, "goodput/fraction") == [3]  # the rerun's ledger is in its own run, not after the first's
    for run in (a, b):
        written = set(events[run].Tags()["scalars"])
        undocumented = {t for t in written if t not in TAGS and not t.startswith("straggler/slowdown/")}
        assert not undocumented, undocumented
        assert tensorboard_groups(sorted(written))[0] == "Throughput"
        assert "plan/text_summary" in events[run].Tags()["tensors"]
        assert steps(run, "goodput/fraction") == steps(run, "train/loss")  # one point per step, the last final

    layout = json.loads(plugin.layout_impl(ctx, experiment=""))  # the JSON the Custom Scalars tab reads
    (category,) = layout["category"]
    assert category["title"] == board.CATEGORY
    charts = {c["title"]: c["multiline"]["tag"] for c in category["chart"]}
    assert list(charts) == list(LAYOUT[board.CATEGORY])
    assert [t for tags in charts.values() for t in tags] == layout_tags()
    for want in ("throughput", "nodes and pipelines", "memory", "goodput"):
        assert any(title.startswith(want) for title in charts), (want, list(charts))
    for title, regexes in charts.items():
        for regex in regexes:  # what the browser fetches for each line of a chart
            body = plugin.scalars_impl(ctx, b, regex, experiment="")
            assert body["tag_to_events"], f"chart {title!r}: no tag written matches {regex!r}"
    assert {f"goodput/{c.value}" for c in Category} <= set(events[b].Tags()["scalars"])


def test_the_training_page_lists_every_tag_and_none_of_the_old_names() -> None:
    readme = (ROOT / "docs" / "training.md").read_text()
    categories = {f"goodput/{c.value}": f"`{c.value}`" for c in Category}
    missing = [t for t in TAGS if categories.get(t, f"`{t}`") not in readme]
    assert not missing, f"docs/training.md's TensorBoard paragraph does not name {missing}"
    old = ("`train/tokens_per_s`", "`train/samples_per_s`", "`perf/", "`reconfiguration/seconds`", "`train/wall_s`")
    assert not [name for name in old if name in readme]
