"""Profiling progress: the time-left estimate on made-up timings, the lines a fake clock produces,
and the lines the profiler writes while it measures."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from oobleck_elastic.planning.profile.profiler import layers_to_measure, profile_layer_by_layer
from oobleck_elastic.planning.profile.progress import ProfileProgress, format_seconds, time_left


def test_time_left_from_the_current_layers_runs_and_the_finished_layers() -> None:
    assert time_left([], [], 6, 3) is None  # nothing timed yet
    # first layer, 2 of 6 runs done at 1 s and 3 s: 4 runs left at 2 s, then 3 layers at 6 x 2 s
    assert time_left([], [1.0, 3.0], 6, 3) == pytest.approx(4 * 2.0 + 3 * 12.0)
    # two layers done in 10 s and 30 s: the layers not started take their mean, 20 s each
    assert time_left([10.0, 30.0], [], 6, 2) == pytest.approx(40.0)
    # in a layer: its own runs for the rest of it; the others at the mean of every layer so far
    # (the current one projected from its runs)
    assert time_left([10.0, 30.0], [5.0], 6, 1) == pytest.approx(5 * 5.0 + (10 + 30 + 6 * 5.0) / 3)
    assert time_left([10.0], [], 6, 0) == 0.0
    assert time_left([], [1.0] * 6, 6, 0) == 0.0  # every run done: only the memory pass is left


def test_format_seconds() -> None:
    assert [format_seconds(s) for s in (0.4, 42, 185, 3725, -1)] == ["0 s", "42 s", "3 min 05 s", "1 h 02 min", "0 s"]


def test_progress_lines_on_a_fake_clock() -> None:
    now = [100.0]
    lines: list[str] = []
    p = ProfileProgress(3, 4, lines.append, every_s=5.0, clock=lambda: now[0])
    p.start_layer("embedding")
    for _ in range(4):
        now[0] += 1.0
        p.run_done()
    assert lines == []  # 4 s: no line yet
    now[0] += 2.0
    assert p.layer_done() == "1/3 layers measured, 6 s so far, about 12 s left"  # 2 layers of 6 s
    p.start_layer("block.0")
    now[0] += 6.0
    p.run_done()  # 6 s since the last line: 3 runs of 6 s, then one layer of mean(6, 4 x 6) = 15 s
    assert lines == ["profiling: 1/3 layers measured, measuring block.0 (run 2/4), 12 s so far, about 33 s left"]
    for _ in range(3):
        now[0] += 6.0
        p.run_done()
    assert lines[-1] == "profiling: 1/3 layers measured, measuring block.0 (its memory), 30 s so far, about 15 s left"
    now[0] += 2.0
    assert p.layer_done() == "2/3 layers measured, 32 s so far, about 16 s left"  # mean(6, 26)
    p.start_layer("head")
    now[0] += 20.0
    assert p.layer_done() == "3/3 layers measured, 52 s so far"  # done: no estimate


def test_layers_to_measure_counts_kinds() -> None:
    assert layers_to_measure(None, 6) == 6
    assert layers_to_measure(["e", "b", "b", "b", "b", "h"], 6) == 3
    assert layers_to_measure(["b", "b", "b"], 3) == 2  # the last one is measured with the loss
    assert layers_to_measure(["e", None, None, "h"], 4) == 4


def test_the_profiler_reports_each_run_and_layer() -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)]
    x, labels = torch.randn(2, 8), torch.randn(2, 8)
    lines: list[str] = []
    progress = ProfileProgress(2, 3, lines.append, every_s=0.0)
    profile_layer_by_layer(
        layers.__getitem__,
        3,
        x,
        labels,
        nn.functional.mse_loss,
        kinds=["lin", "lin", "lin"],
        warmup=1,
        repeats=2,
        log=lines.append,
        progress=progress,
    )
    runs = [line for line in lines if line.startswith("profiling: ")]
    assert [r.split(", ")[1] for r in runs] == [
        "measuring layer.0 (run 2/3)",
        "measuring layer.0 (run 3/3)",
        "measuring layer.0 (its memory)",
        "measuring layer.2 (run 2/3)",
        "measuring layer.2 (run 3/3)",
        "measuring layer.2 (its memory)",
    ]
    assert all(r.startswith(("profiling: 0/2 layers measured", "profiling: 1/2 layers measured")) for r in runs)
    layer_lines = [line for line in lines if line.startswith("profiling layer ")]
    assert "1/2 layers measured" in layer_lines[0] and "about" in layer_lines[0]
    assert "identical to layer.0" in layer_lines[1]
    assert layer_lines[2].endswith("2/2 layers measured, " + layer_lines[2].rsplit(", ", 1)[1])
