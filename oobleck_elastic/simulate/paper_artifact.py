"""The paper's comparison as the authors' simulator computes it, and with each correction.

`artifact_systems(inputs, model, trace, corrections)` builds Oobleck, Varuna and Bamboo as the
SOSP'23 artifact's simulator models them (`simulate.artifact`, `simulate.artifact_bamboo`) from the
paper's inputs (their `artifact` section adds what only that simulator uses). `compare()` runs every
model x trace x system twice, artifact-faithful and corrected, and `comparison_table()` prints them
side by side with the change each correction set makes. The story: docs/simulate.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from .artifact import ALL, ArtifactOobleck, ArtifactSystem, ArtifactVaruna, Corrections
from .artifact_bamboo import ArtifactBamboo
from .trace import NodeEvent, load_trace

PUBLISHED = ("oobleck", "varuna", "bamboo")


def _ms(seconds: float) -> int:
    return int(round(float(seconds) * 1000))


def artifact_systems(
    inputs: dict[str, Any], model: str, trace: str, corrections: Corrections = Corrections()
) -> dict[str, ArtifactSystem]:
    """The three published systems for `model` on the trace named `trace` (its stem)."""
    from .paper import table_throughput

    if model not in inputs["models"]:
        raise ValueError(f"unknown model '{model}': choose one of {', '.join(inputs['models'])}")
    m, art = inputs["models"][model], inputs.get("artifact", {})
    top = int(inputs["top_nodes"])
    tp = {k: table_throughput(v, top=top) for k, v in m["throughput"].items()}
    c, batch = m["costs"], float(m["batch"])
    by_nodes = art.get("varuna_restart_by_nodes", {}).get(model)
    restart = None
    if by_nodes:
        seconds = table_throughput(by_nodes, top=top)
        restart = lambda n: _ms(seconds(n))  # noqa: E731
    spot = trace in art.get("spot_traces", [])
    rollback = not (spot and model in art.get("varuna_no_rollback_on_spot", []) and not corrections.spot_rollback)
    return {
        "oobleck": ArtifactOobleck(batch, tp["oobleck"], _ms(c["oobleck"]), corrections),
        "varuna": ArtifactVaruna(
            batch,
            tp["varuna"],
            _ms(c["varuna_restart"]),
            corrections,
            checkpoint_ms=_ms(c["varuna_checkpoint"]),
            checkpoint_every=int(inputs.get("varuna_checkpoint_every", 10)),
            rollback=rollback,
            restart_by_nodes=restart,
        ),
        "bamboo": ArtifactBamboo(
            batch, tp["bamboo"], _ms(c["bamboo"]), corrections, restart_ms=_ms(inputs.get("bamboo_restart_s", 30))
        ),
    }


def run_cell(
    inputs: dict[str, Any], model: str, trace: str, events: list[NodeEvent], corrections: Corrections = Corrections()
) -> dict[str, float]:
    """Average samples/s per published system for one model on one trace."""
    return {name: s.run(events) for name, s in artifact_systems(inputs, model, trace, corrections).items()}


@dataclass(frozen=True)
class Cell:
    model: str
    trace: str
    system: str
    artifact: float
    """Samples/s as the authors' simulator computes it."""
    corrected: float
    """Samples/s with the corrections applied."""

    def row(self, corrections: Corrections) -> dict[str, Any]:
        return {
            "model": self.model,
            "trace": self.trace,
            "system": self.system,
            "artifact_samples_per_s": self.artifact,
            "corrected_samples_per_s": self.corrected,
            "corrections": corrections.label(),
        }


def compare(
    inputs: dict[str, Any],
    *,
    corrections: Corrections = ALL,
    models: Optional[Sequence[str]] = None,
    traces: Optional[Sequence[str]] = None,
    systems: Sequence[str] = PUBLISHED,
) -> list[Cell]:
    """Every model x trace x published system, artifact-faithful and corrected."""
    from .paper import trace_path

    cells = []
    for trace in traces or inputs["traces"]:
        events, name = load_trace(trace_path(trace)), Path(trace).stem
        for model in models or list(inputs["models"]):
            faithful = run_cell(inputs, model, name, events)
            fixed = run_cell(inputs, model, name, events, corrections)
            cells += [Cell(model, name, s, faithful[s], fixed[s]) for s in systems]
    return cells


def comparison_table(cells: Sequence[Cell], *, artifact_only: bool = False) -> str:
    """One line per (model, trace): each system's artifact-faithful samples/s, then (unless
    `artifact_only`) its corrected samples/s and the change."""
    systems = list(dict.fromkeys(c.system for c in cells))
    rows: dict[tuple[str, str], dict[str, Cell]] = {}
    for c in cells:
        rows.setdefault((c.model, c.trace), {})[c.system] = c
    head = f"{'model':<13} {'trace':<16}"
    for s in systems:
        head += (
            f" {s + ' (artifact)':>19}" if artifact_only else f" {s + ' artifact':>17} {'corrected':>10} {'change':>7}"
        )
    out = [head]
    for (model, trace), by in rows.items():
        line = f"{model:<13} {trace:<16}"
        for s in systems:
            c = by[s]
            if artifact_only:
                line += f" {c.artifact:>19.3f}"
                continue
            change = f"{c.corrected / c.artifact - 1:+.0%}" if c.artifact else ("-" if not c.corrected else "new")
            line += f" {c.artifact:>17.3f} {c.corrected:>10.3f} {change:>7}"
        out.append(line)
    return "\n".join(out)
