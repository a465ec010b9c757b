"""The feature matrix of launched jobs (tests/jobs/test_matrix.py): the features a user combines, a
covering array of them (every pair of two features' values in at least one row) and which rows
the job refuses on purpose. Pure: no torch, no job; tests/unit/test_matrix.py checks the cover.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Optional, Sequence

Row = dict[str, Any]

FEATURES: dict[str, tuple[Any, ...]] = {
    "schedule": ("1f1b", "interleaved-1f1b", "zero-bubble", "zbv"),
    "event": ("none", "kill-holder", "kill-leader", "join"),
    "shadows": (0, 1),
    "compile": (False, True),
    "tp": (1, 2),
    "precision": ("fp32", "bf16"),
}
"""Each feature and its values: the pipeline schedule, what happens during the job (a follower,
which holds layers, or the leader SIGKILLed at step 3, or a node joining at step 3), shadow copies
(`fault_tolerance.shadow_copies`), compiled layers (`training.compile`), tensor-parallel degree
(`planning.tensor_parallel`, two workers a node), precision (`training.precision`)."""


def refusal(row: Row) -> Optional[str]:
    """The pair of keys the job refuses in `row`, as the start-up check names them, or None."""
    if row["shadows"] > 0 and row["tp"] > 1:
        return "fault_tolerance.shadow_copies=1 with tensor parallelism"
    return None


def product(features: dict[str, Sequence[Any]]) -> list[Row]:
    """Every combination of the features' values, in order."""
    names = list(features)
    return [dict(zip(names, values)) for values in itertools.product(*(features[n] for n in names))]


def pairs(row: Row) -> set[tuple[str, Any, str, Any]]:
    """The (feature, value, feature, value) pairs `row` covers, features in the row's order."""
    names = list(row)
    return {(a, row[a], b, row[b]) for i, a in enumerate(names) for b in names[i + 1 :]}


def covering_array(
    features: dict[str, Sequence[Any]],
    allowed: Callable[[Row], bool] = lambda r: True,
    cost: Callable[[Row], float] = lambda r: 0.0,
) -> list[Row]:
    """Rows of allowed combinations that together cover every pair of values that some allowed
    combination holds: greedily, each row the combination that covers the most pairs not covered
    yet, the cheapest of those (`cost`), the first in product order of equals. Deterministic; for
    the features above it gives 17 rows, one more than the two 4-valued features need."""
    candidates = [r for r in product(features) if allowed(r)]
    todo = set().union(*(pairs(r) for r in candidates)) if candidates else set()
    rows: list[Row] = []
    while todo:
        best = max(candidates, key=lambda r: (len(pairs(r) & todo), -cost(r)))  # max keeps the first
        rows.append(best)
        todo -= pairs(best)
    return rows


def seconds(row: Row) -> float:
    """A row's rough cost, for choosing among rows that cover as much: compiling the layers costs
    most, then two workers a node, then an event (a rough order of what each adds to a job here)."""
    return (
        3.0 * row["compile"]
        + 2.0 * (row["tp"] > 1)
        + (row["event"] != "none")
        + 0.5 * (row["precision"] == "bf16")
        + 0.5 * row["shadows"]
    )


def name(row: Row) -> str:
    """A row's test id: its values joined by '-', e.g. 'zbv-join-shadows1-compiled-tp1-bf16'."""
    return "-".join(
        [
            row["schedule"],
            row["event"],
            f"shadows{row['shadows']}",
            "compiled" if row["compile"] else "eager",
            f"tp{row['tp']}",
            row["precision"],
        ]
    )


PAIRWISE: list[Row] = covering_array(FEATURES, allowed=lambda r: refusal(r) is None, cost=seconds)
"""The rows CI runs: every pair of values of two features that the job accepts together."""
FULL: list[Row] = [r for r in product(FEATURES) if refusal(r) is None]
"""The rows `make test-all` runs: every combination the job accepts."""
