"""The Oobleck paper's comparison, from its shipped inputs (the `sosp23` inputs).

`systems_for(inputs, model)` builds the five system models for one model of the paper: the
three published ones with the authors' measured throughput tables and per-event costs, and two
more on the same inputs: this project (`oobleck_elastic`, on Oobleck's throughput table, with
its own per-event costs: detection, re-planning, and the layer transfer of the model's size)
and torchrun checkpoint-restart (`checkpoint_restart`, Oobleck's table for a static plan, a
Varuna-sized restart, a checkpoint every `varuna_checkpoint_every` steps). `run_paper()` replays
every trace for every model and system, one row per run. The story: docs/simulate.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

from .shadows import SHADOW_STEP_OVERHEAD
from .systems import Bamboo, CheckpointRestart, Oobleck, OobleckElastic, SystemModel, Varuna, replay
from .timeline import Timeline
from .trace import NodeEvent, load_trace

ROOT = Path(__file__).resolve().parents[2]
INPUTS = ROOT / "configs" / "simulate" / "sosp23.yaml"
TRACES = ROOT / "configs" / "simulate" / "traces"
SYSTEMS = ("oobleck", "varuna", "bamboo", "oobleck_elastic", "checkpoint_restart")
PUBLISHED = ("oobleck", "varuna", "bamboo")
BYTES_PER_PARAM = 16  # bf16 weights and grads, fp32 master weights and two Adam moments


def load_inputs(path: str | Path = INPUTS) -> dict[str, Any]:
    """The paper's inputs; raises ValueError naming what is missing."""
    data = yaml.safe_load(Path(path).read_text())
    for key in ("min_nodes", "top_nodes", "provisioning_s", "models", "traces"):
        if key not in data:
            raise ValueError(f"{path}: missing '{key}'")
    return data


def table_throughput(values: Sequence[float], *, top: int) -> Any:
    """Samples/s for n nodes from a table of top, top-1, ... nodes: above the table its first
    entry, below it its last (the authors' simulator; no interpolation)."""
    values = list(values)

    def tput(n: int) -> float:
        i = min(max(top - n, 0), len(values) - 1)
        return float(values[i])

    return tput


def even_pipelines(n0: int):
    """Pipelines of the plan for n nodes, as node counts: as many as n // n0 allows, near-equal."""

    def sizes(n: int) -> list[int]:
        k = max(1, n // n0)
        return [n // k + (1 if i < n % k else 0) for i in range(k)]

    return sizes


def smallest_template(tput: Any, min_nodes: int, top: int) -> int:
    """Oobleck's n0 as its table implies it: Oobleck runs f+1 = 2 pipelines on the fewest nodes
    its table runs on (6.7B needs 16 nodes: n0 = 8), so n0 = half of that count, rounded up."""
    fewest = next((n for n in range(min_nodes, top + 1) if tput(n) > 0), top)
    return -(-fewest // 2)


def shadow_name(copies: int) -> str:
    """The name of `oobleck_elastic` run with `copies` shadow copies of every layer."""
    return "oobleck_elastic" if copies == 0 else f"oobleck_elastic:s={copies}"


def with_shadows(names: Sequence[str], shadow_copies: Sequence[int]) -> list[str]:
    """`names` with `oobleck_elastic` followed by its runs with each of `shadow_copies` (the
    baseline without shadows added where it is missing)."""
    extra = [shadow_name(s) for s in dict.fromkeys(shadow_copies) if s > 0]
    if not extra:
        return list(names)
    names = list(names) if "oobleck_elastic" in names else [*names, "oobleck_elastic"]
    at = names.index("oobleck_elastic") + 1
    return names[:at] + [n for n in extra if n not in names] + names[at:]


def systems_for(
    inputs: dict[str, Any],
    model: str,
    names: Sequence[str] = SYSTEMS,
    *,
    shadow_overhead: float = SHADOW_STEP_OVERHEAD,
) -> list[SystemModel]:
    """The named systems for `model`; `oobleck_elastic:s=N` is `oobleck_elastic` with N shadow
    copies of every layer, each slowing its steps by `shadow_overhead`."""
    if model not in inputs["models"]:
        raise ValueError(f"unknown model '{model}': choose one of {', '.join(inputs['models'])}")
    m = inputs["models"][model]
    top, low = int(inputs["top_nodes"]), int(inputs["min_nodes"])
    tp = {k: table_throughput(v, top=top) for k, v in m["throughput"].items()}
    c, batch = m["costs"], float(m["batch"])
    every = int(inputs.get("varuna_checkpoint_every", 10))
    made: dict[str, SystemModel] = {
        "oobleck": Oobleck("oobleck", tp["oobleck"], batch, min_nodes=low, reconfiguration_s=c["oobleck"]),
        "varuna": Varuna(
            "varuna",
            tp["varuna"],
            batch,
            min_nodes=low,
            restart_s=c["varuna_restart"],
            checkpoint_every=every,
            checkpoint_s=c["varuna_checkpoint"],
        ),
        "bamboo": Bamboo(
            "bamboo",
            tp["bamboo"],
            batch,
            min_nodes=low,
            reconfiguration_s=c["bamboo"],
            restart_s=float(inputs.get("bamboo_restart_s", 30)),
            redundant_fraction=1 - float(inputs.get("bamboo_useful_fraction", 0.1971)),
        ),
        "oobleck_elastic": OobleckElastic(
            "oobleck_elastic",
            tp["oobleck"],
            batch,
            min_nodes=low,
            replica_bytes=float(m.get("params", 0)) * BYTES_PER_PARAM,
            num_layers=int(m.get("layers", 0)),
            restart_s=c["varuna_restart"],
            checkpoint_every=10 * every,
            checkpoint_s=c["varuna_checkpoint"],
            pipelines=even_pipelines(smallest_template(tp["oobleck"], low, top)),
        ),
        "checkpoint_restart": CheckpointRestart(
            "checkpoint_restart",
            tp["oobleck"],
            batch,
            min_nodes=low,
            restart_s=c["varuna_restart"],
            checkpoint_every=every,
            checkpoint_s=c["varuna_checkpoint"],
        ),
    }
    base = made["oobleck_elastic"]
    assert isinstance(base, OobleckElastic)
    for name in names:
        head, _, copies = name.partition(":s=")
        if head == "oobleck_elastic" and copies.isdigit() and int(copies) > 0:
            made[name] = replace(
                base, name=name, configured=[], shadow_copies=int(copies), shadow_overhead=shadow_overhead
            )
    unknown = [n for n in names if n not in made]
    if unknown:
        raise ValueError(
            f"unknown system(s) {unknown}: choose from {', '.join(SYSTEMS)} (oobleck_elastic:s=N: with N shadow copies)"
        )
    return [made[n] for n in names]


@dataclass(frozen=True)
class Run:
    model: str
    trace: str
    system: str
    timeline: Timeline

    def row(self) -> dict[str, Any]:
        tl = self.timeline
        return {
            "model": self.model,
            "trace": self.trace,
            "system": self.system,
            "samples_per_s": tl.average_samples_per_s(),
            "samples": tl.samples,
            "seconds": tl.t,
            "breakdown_s": {k: round(v, 3) for k, v in tl.breakdown.items()},
            "idle_gpu_fraction": round(tl.idle_fraction, 4),
        } | (shadow_fields(tl) if self.system.startswith("oobleck_elastic") else {})


def shadow_fields(tl: Timeline) -> dict[str, Any]:
    """What an `oobleck_elastic` run's shadow copies did: restores after a lost layer, losses
    recovered from shadows instead, the steps a restore would have redone, and the most host
    memory the shadows took on one node at the start (reported, not charged)."""
    return {
        "restores": int(tl.counts.get("restores", 0)),
        "shadow_recoveries": int(tl.counts.get("shadow_recoveries", 0)),
        "steps_not_redone": int(tl.counts.get("steps_not_redone", 0)),
        "host_shadow_gb_per_node": round(tl.counts.get("host_shadow_bytes_per_node", 0) / 1e9, 3),
    }


def trace_path(name: str) -> Path:
    path = Path(name)
    return path if path.suffix == ".csv" else TRACES / f"{name}.csv"


def simulate(
    events: list[NodeEvent], systems: Sequence[SystemModel], *, provisioning_s: float, end_s: Optional[float] = None
) -> list[Timeline]:
    return [replay(s, events, provisioning_s=provisioning_s, end_s=end_s) for s in systems]


def run_paper(
    inputs: Optional[dict[str, Any]] = None,
    *,
    models: Optional[Sequence[str]] = None,
    traces: Optional[Sequence[str]] = None,
    systems: Sequence[str] = SYSTEMS,
    shadow_overhead: float = SHADOW_STEP_OVERHEAD,
) -> list[Run]:
    """Every model x trace x system of the paper's comparison (`oobleck_elastic:s=N` among the
    systems: with N shadow copies)."""
    inputs = inputs or load_inputs()
    runs = []
    for trace in traces or inputs["traces"]:
        events = load_trace(trace_path(trace))
        for model in models or list(inputs["models"]):
            for system, tl in zip(
                systems,
                simulate(
                    events,
                    systems_for(inputs, model, systems, shadow_overhead=shadow_overhead),
                    provisioning_s=float(inputs["provisioning_s"]),
                ),
            ):
                runs.append(Run(model=model, trace=Path(trace).stem, system=system, timeline=tl))
    return runs


def paper_table(runs: Sequence[Run]) -> str:
    """Average samples/s per (model, trace), one column per system, and Oobleck's ratios."""
    systems = list(dict.fromkeys(r.system for r in runs))
    cells: dict[tuple[str, str], dict[str, float]] = {}
    for r in runs:
        cells.setdefault((r.model, r.trace), {})[r.system] = r.timeline.average_samples_per_s()
    head = f"{'model':<13} {'trace':<16}" + "".join(f" {s:>18}" for s in systems)
    ratios = [(a, b) for a, b in (("oobleck", "varuna"), ("oobleck", "bamboo")) if a in systems and b in systems]
    head += "".join(f" {a[:7]}/{b[:6]:>6}" for a, b in ratios)
    out = [head]
    for (model, trace), v in cells.items():
        line = f"{model:<13} {trace:<16}" + "".join(f" {v.get(s, 0.0):>18.3f}" for s in systems)
        for a, b in ratios:
            line += f" {v[a] / v[b]:>14.2f}" if v.get(b) else f" {'inf' if v.get(a) else '-':>14}"
        out.append(line)
    return "\n".join(out)
