"""Printing and plotting simulation results: a table, JSON lines, a PNG of throughput over time."""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Sequence

from .timeline import CATEGORIES, Timeline


def summary_table(named: Sequence[tuple[str, Timeline]]) -> str:
    """Average samples/s, total samples, the time breakdown (share of the run) and the share of
    the usable node-time in which nodes did not train (idle GPUs), per system."""
    head = (
        f"{'system':<20} {'samples/s':>10} {'samples':>12} "
        + " ".join(f"{c:>15}" for c in CATEGORIES)
        + f" {'idle GPUs':>10}"
    )
    out = [head]
    for name, tl in named:
        total = sum(tl.breakdown.values()) or 1.0
        out.append(
            f"{name:<20} {tl.average_samples_per_s():>10.3f} {tl.samples:>12.0f} "
            + " ".join(f"{tl.breakdown[c] / total:>15.1%}" for c in CATEGORIES)
            + f" {tl.idle_fraction:>10.1%}"
        )
    return "\n".join(out)


def shadow_table(rows: Sequence[dict]) -> str:
    """What shadow copies buy `oobleck_elastic`, one line per run and shadow count: average
    samples/s and its change against the same run without shadows, restores after a lost layer,
    losses recovered from shadows instead (restores avoided), the committed steps a restore would
    have redone, and the most host memory shadows take on one node (reported, not charged). `rows`:
    `paper.Run.row()`-like dicts (`model`, `trace` optional) of `oobleck_elastic` and
    `oobleck_elastic:s=N` runs."""
    head = (
        f"{'run':<30} {'shadows':>7} {'samples/s':>10} {'vs s=0':>8} {'restores':>8} {'avoided':>8} "
        f"{'steps not redone':>16} {'host GB/node':>12}"
    )
    out = [head]
    base: dict[str, float] = {}
    for r in rows:
        if not str(r["system"]).startswith("oobleck_elastic"):
            continue
        label = " ".join(str(r[k]) for k in ("model", "trace") if k in r) or f"{r.get('nodes', '-')} nodes"
        copies = int(str(r["system"]).partition(":s=")[2] or 0)
        if copies == 0:
            base[label] = r["samples_per_s"]
        ref = base.get(label)
        change = f"{r['samples_per_s'] / ref - 1:+.2%}" if ref else "-"
        out.append(
            f"{label:<30} {copies:>7} {r['samples_per_s']:>10.3f} {change:>8} {r.get('restores', 0):>8} "
            f"{r.get('shadow_recoveries', 0):>8} {r.get('steps_not_redone', 0):>16} "
            f"{r.get('host_shadow_gb_per_node', 0.0):>12.3f}"
        )
    return "\n".join(out)


def throughput_series(tl: Timeline, *, bins: int = 200, end: float | None = None) -> tuple[list[float], list[float]]:
    """(bin centres in hours, samples/s committed in each bin) from a timeline's curve; a
    rollback shows as a bin below zero (work taken back)."""
    end = end if end is not None else tl.t
    if end <= 0 or not tl.curve:
        return [], []
    width = end / bins
    times = [t for t, _ in tl.curve]
    samples = [s for _, s in tl.curve]

    def at(t: float) -> float:  # linear between the curve's points
        i = bisect.bisect_right(times, t) - 1
        if i < 0:
            return 0.0
        if i + 1 >= len(times) or times[i + 1] <= times[i] or samples[i + 1] < samples[i]:
            return samples[i]
        return samples[i] + (samples[i + 1] - samples[i]) * (t - times[i]) / (times[i + 1] - times[i])

    xs, ys = [], []
    for b in range(bins):
        lo, hi = b * width, (b + 1) * width
        xs.append((lo + hi) / 2 / 3600)
        ys.append((at(hi) - at(lo)) / width)
    return xs, ys


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def plot(named: Sequence[tuple[str, Timeline]], path: str | Path, *, title: str = "") -> Path:
    """A PNG of throughput over time, one line per system."""
    plt = _pyplot()
    end = max(tl.t for _, tl in named)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, tl in named:
        xs, ys = throughput_series(tl, end=end)
        ax.plot(xs, ys, label=f"{name} (avg {tl.average_samples_per_s():.3g})", linewidth=1.2)
    ax.set_xlabel("hours")
    ax.set_ylabel("samples/s")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_paper(rows: Sequence[dict], path: str | Path) -> Path:
    """Average samples/s of every system for every (model, trace) of the paper's comparison,
    one panel per model, normalised to Oobleck's."""
    plt = _pyplot()
    models = list(dict.fromkeys(r["model"] for r in rows))
    traces = list(dict.fromkeys(r["trace"] for r in rows))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    value = {(r["model"], r["trace"], r["system"]): r["samples_per_s"] for r in rows}
    fig, axes = plt.subplots(1, len(models), figsize=(4 * len(models), 3.8), squeeze=False)
    width = 0.8 / len(systems)
    for ax, model in zip(axes[0], models):
        for k, system in enumerate(systems):
            ys = [value.get((model, t, system), 0.0) for t in traces]
            ax.bar([i + k * width for i in range(len(traces))], ys, width, label=system)
        ax.set_title(model)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(traces))])
        ax.set_xticklabels(traces, rotation=60, fontsize=7)
    axes[0][0].set_ylabel("average samples/s")
    axes[0][-1].legend(fontsize=7)
    return _save(fig, path)
