"""The sample ledger: which samples every step consumed, and the check that each was used once.

Workers record what they fed, applied, skipped and restored; `check` proves every step committed
once, on exactly the samples the sampler gives it. The story: docs/guarantees.md.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

__all__ = ["EVENT", "SampleReport", "check", "runs", "describe"]

EVENT = "samples"
"""The `event` of every ledger line in the events files."""

Runs = tuple[tuple[int, int], ...]


def runs(positions: Iterable[int]) -> list[list[int]]:
    """Sorted positions as `[start, end)` runs; a position taken twice is kept twice (a run of it
    alone), so a repeat within one batch shows."""
    out: list[list[int]] = []
    for p in sorted(int(x) for x in positions):
        if out and out[-1][1] == p:
            out[-1][1] = p + 1
        else:
            out.append([p, p + 1])
    return out


def _fmt(r: Runs) -> str:
    return " ".join(f"[{a},{b})" for a, b in r) or "nothing"


@dataclass(frozen=True)
class _Fed:
    t: float
    gen: int
    step: int
    pipeline: int
    pipelines: int
    slice: tuple[int, int]
    batch: int
    steps_per_epoch: int
    steps: int
    epoch: int
    positions: Runs


@dataclass(frozen=True)
class _Commit:
    t: float
    kind: str  # applied | skipped
    gen: int
    step: int
    writer: tuple[str, int] = ("", -1)
    """(node, rank) of the worker that wrote it."""


@dataclass(frozen=True)
class _Restored:
    t: float
    gen: int
    step: int


def _runs_of(value: Any) -> Runs:
    out = []
    for r in value:
        a, b = int(r[0]), int(r[1])
        if b < a:
            raise ValueError(f"run [{a},{b}) ends before it starts")
        out.append((a, b))
    return tuple(out)


def _parse(line: dict) -> _Fed | _Commit | _Restored:
    """One ledger line; ValueError/KeyError/TypeError when malformed."""
    kind, t, gen, step = line["kind"], float(line["t"]), int(line["gen"]), int(line["step"])
    if kind == "fed":
        a, b = (int(x) for x in line["slice"])
        return _Fed(
            t,
            gen,
            step,
            int(line["pipeline"]),
            int(line["pipelines"]),
            (a, b),
            int(line["batch"]),
            int(line["steps_per_epoch"]),
            int(line["steps"]),
            int(line["epoch"]),
            _runs_of(line["positions"]),
        )
    if kind in ("applied", "skipped"):
        return _Commit(t, kind, gen, step, (str(line.get("node", "")), int(line.get("rank", -1))))
    if kind == "restored":
        return _Restored(t, gen, step)
    raise ValueError(f"unknown kind {kind!r}")


@dataclass
class SampleReport:
    """What `check` found."""

    steps: int
    """Steps the job was asked for (training.steps, from the records unless given)."""
    applied: int = 0
    skipped: list[int] = field(default_factory=list)
    """Steps whose batch the step guard skipped."""
    reruns: int = 0
    """Attempts not counted: replays, steps of broken generations, steps run again after a restore."""
    restores: int = 0
    generations: list[int] = field(default_factory=list)
    """Generations that fed a step."""
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _restore_events(restores: Sequence[_Restored], commits: Sequence[_Commit]) -> list[_Restored]:
    """One restore per event, at its first worker's time: every worker of a generation writes its
    own record as it restores, and a fast one may take the generation's first batch before a slow
    one has written its record; none commits before all have restored (the step's collectives),
    so the records of one (generation, step) with no commit between them are one restore."""
    events: list[_Restored] = []
    commit_times = sorted(c.t for c in commits)
    for r in sorted(restores, key=lambda r: r.t):
        last = next((e for e in reversed(events) if (e.gen, e.step) == (r.gen, r.step)), None)
        if last is not None and bisect.bisect_right(commit_times, last.t) == bisect.bisect_left(commit_times, r.t):
            continue  # the same event (no commit in between): it began at `last.t`
        events.append(r)
    return events


def _undone(rec: _Commit | _Fed, restores: Sequence[_Restored]) -> bool:
    """A commit, or a batch taken, that a later restore rolled back (its step is re-run)."""
    return any(r.t > rec.t and r.step <= rec.step for r in restores)


def check(lines: Iterable[dict], steps: Optional[int] = None) -> SampleReport:
    """Prove the ledger `lines` (the `samples` event lines of a job, any order) exactly-once (module
    docstring); `steps`: the job's step count (default: the records' `steps`)."""
    fed: list[_Fed] = []
    commits: list[_Commit] = []
    restores: list[_Restored] = []
    problems: list[str] = []
    for line in lines:
        try:
            rec = _parse(line)
        except (KeyError, TypeError, ValueError) as err:
            problems.append(f"unreadable ledger line ({type(err).__name__}: {err}): {line}")
            continue
        if isinstance(rec, _Fed):
            fed.append(rec)
        elif isinstance(rec, _Commit):
            commits.append(rec)
        else:
            restores.append(rec)
    if steps is None:
        steps = max((f.steps for f in fed), default=0)
    restores = _restore_events(restores, commits)
    report = SampleReport(steps=steps, restores=len(restores), generations=sorted({f.gen for f in fed}))
    if not fed and not commits:
        report.problems = problems + ["no sample ledger records (was logging.events_dir set for the job?)"]
        return report

    # 1. one live commit per step
    live: dict[int, set[tuple[str, int]]] = {}
    by_writer: dict[tuple[int, str, int, tuple[str, int]], int] = {}
    for c in commits:
        if not _undone(c, restores):
            live.setdefault(c.step, set()).add((c.kind, c.gen))
            key = (c.step, c.kind, c.gen, c.writer)
            by_writer[key] = by_writer.get(key, 0) + 1
    for (s, kind, gen, (node, rank)), n in sorted(by_writer.items()):
        if n > 1:  # one worker commits a step once: twice is a re-run that no restore undid
            problems.append(
                f"step {s} {kind} {n} times in generation {gen} by node {node or '?'} rank {rank}: "
                "its samples were repeated"
            )
    never = [s for s in range(steps) if s not in live]
    if never:
        problems.append(f"never committed: step(s) {_spans(never)}")
    beyond = sorted(s for s in live if not 0 <= s < steps)
    if beyond:
        problems.append(f"committed outside steps 0..{steps - 1}: step(s) {_spans(beyond)}")
    applied_in: dict[int, int] = {}
    for s in sorted(live):
        outcomes = sorted(live[s], key=lambda kg: (kg[1], kg[0]))
        if len(outcomes) > 1:
            said = ", ".join(f"{k} in generation {g}" for k, g in outcomes)
            problems.append(f"step {s} committed {len(outcomes)} times ({said}): its samples were repeated")
            continue
        kind, gen = outcomes[0]
        if kind == "skipped":
            report.skipped.append(s)
        else:
            applied_in[s] = gen
    report.applied = len(applied_in)

    # 2. each applied step consumed exactly the sampler's block, over its generation's pipelines
    by_attempt: dict[tuple[int, int], list[_Fed]] = {}
    for f in fed:
        if not _undone(f, restores):  # a job resumed anew counts generations from 1 again
            by_attempt.setdefault((f.step, f.gen), []).append(f)
    consumed: dict[int, dict[int, int]] = {}  # epoch -> position -> step
    for s, gen in sorted(applied_in.items()):
        records = by_attempt.get((s, gen), [])
        problems.extend(_step_problems(s, gen, records, consumed))
    # 3. (in _step_problems) positions consumed twice within an epoch
    attempts = _attempts(fed)
    counted = sum(1 for s, gen in applied_in.items() if (s, gen) in attempts)
    counted += sum(1 for s in report.skipped if any(k[0] == s for k in attempts))
    report.reruns = sum(len(v) for v in attempts.values()) - counted
    report.problems = problems
    return report


def _attempts(fed: Sequence[_Fed]) -> dict[tuple[int, int], list[_Fed]]:
    """Attempts per (step, generation), as seen by pipeline 0's feeder (one line per attempt)."""
    out: dict[tuple[int, int], list[_Fed]] = {}
    for f in fed:
        if f.pipeline == 0:
            out.setdefault((f.step, f.gen), []).append(f)
    return out


def _step_problems(s: int, gen: int, records: Sequence[_Fed], consumed: dict[int, dict[int, int]]) -> list[str]:
    where = f"step {s} (fed in generation {gen})"
    if not records:
        return [f"{where}: applied, but no record of the samples it consumed"]
    first = records[0]
    shape = {(r.pipelines, r.batch, r.steps_per_epoch) for r in records}
    if len(shape) > 1:
        return [f"{where}: its records disagree on (pipelines, batch, steps per epoch): {sorted(shape)}"]
    pipelines, batch, per_epoch = first.pipelines, first.batch, first.steps_per_epoch
    per_pipeline: dict[int, set[tuple[tuple[int, int], int, Runs]]] = {}
    for r in records:
        per_pipeline.setdefault(r.pipeline, set()).add((r.slice, r.epoch, r.positions))
    out = []
    missing = [p for p in range(pipelines) if p not in per_pipeline]
    if missing:
        out.append(f"{where}: no record of what pipeline(s) {missing} of {pipelines} consumed")
    for p, seen in sorted(per_pipeline.items()):
        if len(seen) > 1:
            said = "; ".join(f"slice {sl} epoch {e} positions {_fmt(pos)}" for sl, e, pos in sorted(seen))
            out.append(f"{where}: pipeline {p} consumed different samples in its attempts: {said}")
    if out:
        return out
    epoch, block = divmod(s, per_epoch)
    base = block * batch
    cursor = 0
    for p in range(pipelines):
        (a, b), e, positions = next(iter(per_pipeline[p]))
        if a != cursor:
            out.append(
                f"{where}: pipeline {p}'s slice [{a},{b}) of the batch starts at {a}, not {cursor}: "
                + ("samples overlap" if a < cursor else "samples are left out")
            )
        cursor = max(cursor, b)
        want = ((base + a, base + b),) if b > a else ()
        if e != epoch or positions != want:
            out.append(
                f"{where}: pipeline {p} consumed positions {_fmt(positions)} of epoch {e}; the sampler's "
                f"batch gives it {_fmt(want)} of epoch {epoch}"
            )
        taken = consumed.setdefault(e, {})
        twice: dict[int, list[int]] = {}
        for lo, hi in positions:
            for pos in range(lo, hi):
                if pos in taken:
                    twice.setdefault(taken[pos], []).append(pos)
                taken[pos] = s
        for other, where_twice in sorted(twice.items()):
            by = f"by step {other} too" if other != s else f"twice in this step (pipeline {p} and an earlier one)"
            spans = _fmt(tuple((x, y + 1) for x, y in _pairs(where_twice)))
            out.append(f"{where}: positions {spans} of epoch {e} were consumed {by}")
    if cursor != batch:
        out.append(f"{where}: the pipelines' slices end at {cursor}, not at the batch size {batch}")
    return out


def _pairs(values: list[int]) -> list[tuple[int, int]]:
    """Sorted values as inclusive (first, last) spans."""
    out: list[tuple[int, int]] = []
    for v in sorted(set(values)):
        if out and out[-1][1] == v - 1:
            out[-1] = (out[-1][0], v)
        else:
            out.append((v, v))
    return out


def _spans(values: list[int]) -> str:
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in _pairs(values))


def describe(report: SampleReport) -> list[str]:
    """The report as lines for `oobleck samples --check`: the verdict first, then each problem."""
    verdict = "exactly once" if report.ok else f"NOT exactly once ({len(report.problems)} problem(s))"
    skipped = f"step(s) {_spans(report.skipped)}" if report.skipped else "none"
    lines = [
        f"samples: {verdict}: {report.applied} of {report.steps} steps applied, "
        f"{len(report.skipped)} skipped by the step guard ({skipped}); "
        f"{report.reruns} attempt(s) not counted (replays, broken generations, re-runs after "
        f"{report.restores} restore(s)); generations {_spans(report.generations) or 'none'}"
    ]
    lines += [f"  {p}" for p in report.problems]
    return lines
