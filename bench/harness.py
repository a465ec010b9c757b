"""The harness every bench runs under (`python -m bench NAME [--quick] [ARGS...]`).

- `Bench`: what a bench module declares as `BENCH`: its `main(argv)` and the arguments `--quick`
  puts before the user's (a short form: few repeats, small sizes), or None where the bench has no
  short form (it takes minutes whatever its arguments).
- `emit(record)`: prints one JSON line, the record after the context every result carries: the
  bench's name, the commit (`git rev-parse --short HEAD`, "unknown" outside a git checkout), the
  machine's load (`os.getloadavg`, 1, 5 and 15 minutes) when the line was printed, its CPU count
  and the torch version.
- `alternate(sides, rounds)`: runs two (or more) sides in turn, A, B, A, B, ..., and gives each
  side's median and the ratio of the first side's median to the second's.
- `median(xs)`: the median, None for no values.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import statistics
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence, Union

ROOT = Path(__file__).resolve().parents[1]

_running = {"bench": "unknown"}  # the bench `run` started; emit stamps its lines with it


@dataclass(frozen=True)
class Bench:
    """A bench's entry: `main(argv)` runs it; `quick` are the arguments of its short form (put
    before the user's, so the user's win), None where there is none."""

    main: Callable[[Optional[list[str]]], Any]
    quick: Optional[tuple[str, ...]] = None


@functools.lru_cache(maxsize=None)
def commit() -> str:
    """`git rev-parse --short HEAD` of the repository, "unknown" if it is not a git checkout."""
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


@functools.lru_cache(maxsize=None)
def torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def context() -> dict[str, Any]:
    """What every result line carries, the load read now."""
    return {
        "bench": _running["bench"],
        "commit": commit(),
        "load": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
        "torch": torch_version(),
    }


def emit(record: dict[str, Any]) -> None:
    """Print `record` as one JSON line after the context (a key of the record's wins)."""
    print(json.dumps({**context(), **record}), flush=True)


def median(xs: Iterable[float]) -> Optional[float]:
    values = list(xs)
    return statistics.median(values) if values else None


Measure = Callable[[], Union[float, Sequence[float]]]


@dataclass
class Alternation:
    """Each side's measurements in the order taken, their medians, and the ratio of the first
    side's median to the second's (None with fewer than two sides or a zero median)."""

    samples: dict[str, list[float]] = field(default_factory=dict)

    @property
    def medians(self) -> dict[str, Optional[float]]:
        return {name: median(xs) for name, xs in self.samples.items()}

    @property
    def ratio(self) -> Optional[float]:
        meds = list(self.medians.values())
        if len(meds) < 2 or meds[0] is None or not meds[1]:
            return None
        return meds[0] / meds[1]


def alternate(sides: dict[str, Measure], rounds: int, *, swap: bool = False) -> Alternation:
    """Run the sides in turn, `rounds` times: A, B, A, B, ... (with `swap`, every other round
    starts with the other side: A, B, B, A, ...). A side returns one measurement or several (a
    block of steps); all of a side's measurements make its median."""
    result = Alternation({name: [] for name in sides})
    names = list(sides)
    for r in range(rounds):
        order = names[::-1] if swap and r % 2 else names
        for name in order:
            got = sides[name]()
            result.samples[name].extend([float(got)] if isinstance(got, (int, float)) else [float(x) for x in got])
    return result


def run(name: str, bench: Bench, argv: Sequence[str], *, quick: bool = False) -> Any:
    """Run one bench: its lines carry `name`; `quick` puts its short form's arguments first."""
    if quick and bench.quick is None:
        raise SystemExit(f"bench {name} has no --quick form (it takes minutes whatever its arguments)")
    _running["bench"] = name
    return bench.main([*(bench.quick if quick else ()), *argv])
