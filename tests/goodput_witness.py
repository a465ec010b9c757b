"""What a job's JSON event lines (`logging.events_dir`) say about where its time went, read
independently of the goodput ledger, for tests/jobs/test_goodput.py to check the ledger against.

Each thing is measured where it happens, on a clock the ledger does not read: a step's own
`seconds` (`time.perf_counter` inside `Trainer.train_step`) on rank 0's `step` line, a rejected
run's on its `replayed`/`skipped` line, a checkpoint's on its `checkpoint` line (from the start of
the save, or of a retake's look for an existing one, to the manifest; a skipped save's look for
room on its `checkpoint_skipped` line), an entry's on its `entered` line, and every line's `t`
(when it was written). A step's start is its line's `t` less its `seconds`. The ledger charges a
checkpoint to `checkpointing` only when the rank 0 that wrote it reported afterwards (a later step
of its, or the final report), and everything else from a generation's last step to the next
generation's first step to `reconfiguration`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Witness:
    """What a job's JSON event lines say about where its time went, measured where each thing
    happened (a step's, a rejected run's and a checkpoint's own `seconds`, on `time.perf_counter`;
    the lines' `t`), none of it read from the goodput ledger."""

    applied: float
    """Seconds of rank 0's `step` lines, the first run of each step."""
    again: float
    """Seconds of `step` lines of a step already done (run again: `replayed`)."""
    rejected: float
    """Seconds of rank 0's `replayed` lines (the step guard rejected the run)."""
    skipped: float
    """Seconds of rank 0's `skipped` lines."""
    checkpoints: float
    """Seconds of the `checkpoint` (and not retaken `checkpoint_retake`, and `checkpoint_skipped`:
    the look for room) lines whose writer reported
    after them: a later step of its, or the final checkpoint, which the last report covers."""
    gaps: float
    """Between consecutive step runs of different generations: from the end of the one to the
    start of the next (its line's `t` minus its `seconds`), less the checkpoints counted in it."""
    entries: float
    """Seconds of the `entered` lines of the rank 0 of every generation after the first."""
    first_step: float
    """When the job's first step run began."""
    last_line: float
    """When the final checkpoint's line was written (just before the last report)."""
    killed_last: float
    """Seconds of the last step of each killed node: its line may precede a report that never came."""
    counts: dict[str, int]
    """How many of each were summed: `applied`, `again`, `replayed`, `skipped` (step runs),
    `checkpoints`, `changes` (gaps between generations)."""


def witness(events: list[dict], *, steps: int, killed: tuple[str, ...] = ()) -> Witness:
    """The `Witness` of a job's event lines (`read_event_lines`, in time order)."""
    rank0 = {e["gen"]: e["node"] for e in events if e["event"] == "entered" and e.get("rank") == 0}
    runs = []  # (began, ended, kind, 0-based step, generation, node)
    for e in events:
        if e["event"] == "step":  # written by rank 0 alone, at the number of steps done
            runs.append((e["t"] - e["seconds"], e["t"], "step", e["step"] - 1, e["gen"], e["node"]))
        elif e["event"] in ("replayed", "skipped") and rank0.get(e["gen"]) == e["node"]:  # 0-based
            runs.append((e["t"] - e["seconds"], e["t"], e["event"], e["step"], e["gen"], e["node"]))
    runs.sort(key=lambda r: r[1])
    seconds = {"applied": 0.0, "again": 0.0, "replayed": 0.0, "skipped": 0.0}
    counts = dict.fromkeys(seconds, 0)
    done: set[int] = set()
    for began, ended, kind, step, _, _ in runs:
        kind = ("again" if step in done else "applied") if kind == "step" else kind
        seconds[kind] += ended - began
        counts[kind] += 1
        if kind != "replayed":
            done.add(step)
    saved = [
        e
        for e in events
        if e["event"] in ("checkpoint", "checkpoint_skipped") or (e["event"] == "checkpoint_retake" and "seconds" in e)
    ]
    counted = [e for e in saved if e["step"] == steps or any(r[5] == e["node"] and r[1] > e["t"] for r in runs)]
    gaps = 0.0
    for a, b in zip(runs, runs[1:]):
        if a[4] != b[4]:
            inside = sum(e["seconds"] for e in counted if a[1] < e["t"] <= b[0])
            gaps += b[0] - a[1] - inside
    last = {}
    for r in runs:
        if r[2] == "step" and r[5] in killed:
            last[r[5]] = r[1] - r[0]
    final = [e["t"] for e in counted if e["event"] == "checkpoint" and e["step"] == steps]
    return Witness(
        applied=seconds["applied"],
        again=seconds["again"],
        rejected=seconds["replayed"],
        skipped=seconds["skipped"],
        checkpoints=sum(e["seconds"] for e in counted),
        gaps=gaps,
        entries=sum(e["seconds"] for e in events if e["event"] == "entered" and e.get("rank") == 0 and e["gen"] > 1),
        first_step=runs[0][0],
        last_line=final[-1] if final else float("nan"),
        killed_last=sum(last.values()),
        counts={**counts, "checkpoints": len(counted), "changes": sum(a[4] != b[4] for a, b in zip(runs, runs[1:]))},
    )
