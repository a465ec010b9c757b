"""What a template set promises for a fault-tolerance threshold f.

`guarantee()`: every node count >= (f+1)*n0 splits exactly into >= f+1 template-sized pipelines
when the contiguous template range reaches n_max >= 2*n0 - 1; below that, a DP over the actual
template sizes finds the node counts that leave some node idle. docs/planning.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..errors import PlanningError
from ..plan.instantiate import coverage
from ..templates.templates import TemplateSet


@dataclass(frozen=True)
class Guarantee:
    f: int
    """Failures to tolerate."""
    n0: int
    """Fewest nodes for one replica."""
    n_max: int
    """Largest node count of the contiguous template range from n0."""
    meets_2n0: bool
    """n_max >= 2*n0 - 1: every node count >= n0 is an exact sum of template sizes."""
    min_nodes: int
    """(f+1)*n0: the smallest cluster that holds f+1 replicas."""
    covered_from: Optional[int]
    """Every node count >= this runs >= f+1 pipelines with no idle node (None: never all)."""
    uncovered: tuple[int, ...]
    """Counts >= min_nodes that leave some node idle (all of them when finite)."""

    def describe(self) -> str:
        head = (
            f"templates for {self.n0}..{self.n_max} nodes; n_max >= 2*n0-1 = {2 * self.n0 - 1}: "
            f"{'yes' if self.meets_2n0 else 'no'}. "
        )
        if self.covered_from is None:
            return head + (f"f={self.f}: only multiples of {self.n0} nodes can be fully used")
        text = head + (
            f"f={self.f}: every node count >= {self.covered_from} runs >= {self.f + 1} pipelines with no idle node"
        )
        if self.uncovered:
            text += f" (below that, {', '.join(map(str, self.uncovered))} leave nodes idle)"
        return text

    def to_json(self) -> dict[str, Any]:
        return {
            "f": self.f,
            "n0": self.n0,
            "n_max": self.n_max,
            "meets_2n0_minus_1": self.meets_2n0,
            "min_nodes": self.min_nodes,
            "covered_from": self.covered_from,
            "uncovered": list(self.uncovered),
            "text": self.describe(),
        }


def guarantee(templates: TemplateSet, f: int, *, max_nodes: Optional[int] = None) -> Guarantee:
    """What `templates` promise for f; raises PlanningError when `max_nodes` cannot hold f+1 replicas.

    Sums of k sizes from [n0, n_max] cover [k*n0, k*n_max]; consecutive ranges touch once
    k*(n_max - n0) >= n0 - 1, so beyond K*n0 (K the first such k >= f+1) every count is covered;
    below it a DP over the actual template sizes finds the exceptions exactly.
    """
    n0, n_max = templates.n0, templates.n_max
    min_nodes = (f + 1) * n0
    if max_nodes is not None and max_nodes < min_nodes:
        raise PlanningError(
            f"cannot tolerate f={f}: {f + 1} replicas need at least (f+1)*n0 = {min_nodes} nodes "
            f"(n0={n0}) but the job has at most planning.max_nodes={max_nodes}: lower fault_tolerance.f, "
            "add nodes, or give each device more memory (smaller n0)"
        )
    meets = n_max >= 2 * n0 - 1
    if n_max == n0 and n0 > 1:
        return Guarantee(f=f, n0=n0, n_max=n_max, meets_2n0=meets, min_nodes=min_nodes, covered_from=None, uncovered=())
    k = f + 1
    while k * (n_max - n0) < n0 - 1:
        k += 1
    upto = max(min_nodes, k * n0) + n_max
    bad = tuple(coverage(templates, f, upto=upto)[1])
    return Guarantee(
        f=f,
        n0=n0,
        n_max=n_max,
        meets_2n0=meets,
        min_nodes=min_nodes,
        covered_from=(bad[-1] + 1) if bad else min_nodes,
        uncovered=bad,
    )
