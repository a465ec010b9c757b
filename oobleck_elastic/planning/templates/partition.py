"""Stage costs and the exact partition of a model into S stages (the search behind a template).

`StageCosts` holds prefix sums over a profile (the time and memory of any layer range at any
stage position in O(1), vectorised with numpy); `best_partition` runs the two-pass dynamic
programme over them: the least bottleneck, then among partitions within it the least total time.
With `recompute_auto` (`training.activation_checkpoint: auto`) a stage recomputes its
activations exactly when it does not fit without (the profile's recomputed variant). docs/planning.md.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ..comm import Links
from ..errors import PlanningError
from ..profile.profile import ModelProfile

__all__ = ["StageCosts", "best_partition"]


class StageCosts:
    """Prefix sums over a profile: O(1) time and memory of any layer range at any position, and
    the communication of a stage with its neighbours (`links`, `stages_per_node`)."""

    def __init__(
        self,
        profile: ModelProfile,
        *,
        memory_limit_bytes: float,
        schedule: str = "1f1b",
        gpipe_microbatches: int = 1,
        links: Optional[Links] = None,
        stages_per_node: int = 1,
        recompute_auto: bool = False,
    ) -> None:
        if schedule not in ("1f1b", "gpipe"):
            raise PlanningError(f"unknown schedule '{schedule}': use 1f1b or gpipe")
        self.profile = profile
        self.num_layers = profile.num_layers
        self.memory_limit = float(memory_limit_bytes)
        self.schedule = schedule
        self.gpipe_microbatches = gpipe_microbatches
        self.links = links
        self.stages_per_node = stages_per_node
        self.recompute_auto = recompute_auto
        self._time = [0.0]
        self._static = [0]
        self._act = [0]
        self._grad = [0]
        self._time_rc = [0.0]  # recomputed (recompute_auto only)
        self._act_rc = [0]
        for layer in profile.layers:
            self._time.append(self._time[-1] + layer.time_s)
            self._static.append(self._static[-1] + layer.static_bytes)
            self._act.append(self._act[-1] + layer.activation_bytes)
            self._grad.append(self._grad[-1] + layer.grad_bytes)
            if recompute_auto:
                rc = layer.recomputed()
                self._time_rc.append(self._time_rc[-1] + rc.time_s)
                self._act_rc.append(self._act_rc[-1] + rc.activation_bytes)
        self._out = [0] + [layer.output_bytes for layer in profile.layers]  # _out[v]: output of layer v-1
        # the same for every template: [u, v) spans as (L+1) x (L+1) matrices, and each cut's
        # boundary time over a link in a node and across nodes
        t, st, ac = (np.asarray(x, dtype=np.float64) for x in (self._time, self._static, self._act))
        self._span_time = t[None, :] - t[:, None]
        self._span_static = st[None, :] - st[:, None]
        self._span_act = ac[None, :] - ac[:, None]
        if recompute_auto:
            t_rc, ac_rc = (np.asarray(x, dtype=np.float64) for x in (self._time_rc, self._act_rc))
            self._span_time_rc = t_rc[None, :] - t_rc[:, None]
            self._span_act_rc = ac_rc[None, :] - ac_rc[:, None]
        cuts = np.arange(self.num_layers + 1)
        self._empty = cuts[:, None] >= cuts[None, :]
        self._cut_s = {
            same: np.array([links.p2p_s(self._out[c], same_node=same) if links else 0.0 for c in cuts])
            for same in (True, False)
        }
        self._matrices: dict[tuple[int, Optional[bool], Optional[bool]], np.ndarray] = {}
        self._tails: dict[int, list[np.ndarray]] = {}  # num_stages % stages_per_node -> tail(0), tail(1), ...

    def time(self, start: int, end: int, recompute: bool = False) -> float:
        """Forward + backward compute of layers [start, end) (`recompute`: their activations recomputed)."""
        prefix = self._time_rc if recompute else self._time
        return prefix[end] - prefix[start]

    def recomputes(self, start: int, end: int, position: int, num_stages: int) -> bool:
        """Whether the stage recomputes its activations: with `recompute_auto`, when it does not fit without."""
        if not self.recompute_auto:
            return False
        return self._memory(start, end, position, num_stages, self._act) > self.memory_limit

    def grad_bytes(self, start: int, end: int) -> int:
        return self._grad[end] - self._grad[start]

    def same_node(self, position: int) -> bool:
        """Whether stages `position` and `position + 1` are on one node."""
        return (position + 1) % self.stages_per_node != 0

    def boundary_s(self, cut: int, position: int) -> float:
        """Time to send the activation leaving layer cut-1 from stage `position` to the next (the
        gradient coming back takes as long)."""
        if self.links is None:
            return 0.0
        return self.links.p2p_s(self._out[cut], same_node=self.same_node(position))

    def comm(self, start: int, end: int, position: int, num_stages: int) -> float:
        """A stage's receives per microbatch: its input (forward) and its output's gradient (backward)."""
        t = self.boundary_s(start, position - 1) if position > 0 else 0.0
        return t + (self.boundary_s(end, position) if position < num_stages - 1 else 0.0)

    def stage_time(self, start: int, end: int, position: int, num_stages: int) -> float:
        recompute = self.recomputes(start, end, position, num_stages)
        return self.time(start, end, recompute) + self.comm(start, end, position, num_stages)

    def in_flight(self, position: int, num_stages: int) -> int:
        """Microbatches whose activations stage `position` of `num_stages` keeps at once."""
        if self.schedule == "gpipe":
            return self.gpipe_microbatches
        return num_stages - position

    def memory(self, start: int, end: int, position: int, num_stages: int) -> int:
        act = self._act_rc if self.recomputes(start, end, position, num_stages) else self._act
        return self._memory(start, end, position, num_stages, act)

    def _memory(self, start: int, end: int, position: int, num_stages: int, act: list[int]) -> int:
        return self._static[end] - self._static[start] + self.in_flight(position, num_stages) * (act[end] - act[start])

    def matrices(self, position: int, num_stages: int) -> np.ndarray:
        """(L+1) x (L+1) stage times of [u, v) at `position`; inf where u >= v, where it does not
        fit in memory, where stage 0 does not start at 0 or the last stage does not end at L.
        The matrix depends on the position only through the microbatches in flight, whether the
        stage is first or last and which links it receives over: templates of every size share
        them, so they are kept (read-only) for the next template, up to ~64 MB of them."""
        first, last = position == 0, position == num_stages - 1
        key = (
            self.in_flight(position, num_stages),
            None if first else self.same_node(position - 1),
            None if last else self.same_node(position),
        )
        found = self._matrices.get(key)
        if found is None:
            found = self._matrix(*key)
            found.flags.writeable = False
            if len(self._matrices) * found.nbytes > 64e6:
                self._matrices.clear()
            self._matrices[key] = found
        return found

    def tail(self, stages: int, num_stages: int) -> np.ndarray:
        """[u]: the least bottleneck of the last `stages` stages of `num_stages` covering layers
        [u, L) (inf: none fits). A stage's matrix depends on its distance from the end (its
        microbatches in flight, first/last) and on its links, which repeat every
        `stages_per_node` positions; templates have num_stages = nodes x stages_per_node, so every
        template shares one chain: each is computed once, from the one before, and kept."""
        chain = self._tails.setdefault(num_stages % self.stages_per_node, [])
        if not chain:
            chain.append(np.full(self.num_layers + 1, np.inf))
            chain[0][self.num_layers] = 0.0  # no stage left: only the end is covered
        while len(chain) <= stages:  # the stage len(chain) from the end, then the ones after it
            w = self.matrices(num_stages - len(chain), num_stages)
            chain.append(np.maximum(w, chain[-1][None, :]).min(axis=1))
        return chain[stages]

    def _matrix(self, in_flight: int, link_in: Optional[bool], link_out: Optional[bool]) -> np.ndarray:
        """`matrices` for a stage keeping `in_flight` microbatches, receiving its input over a link
        inside a node (True), across nodes (False) or not at all (None: the first stage), and its
        output's gradient likewise (None: the last stage)."""
        n = self.num_layers
        u = np.arange(n + 1)
        mem = self._span_static + in_flight * self._span_act
        w = self._span_time
        if self.recompute_auto:  # recomputed where it does not fit without
            over = mem > self.memory_limit
            mem = np.where(over, self._span_static + in_flight * self._span_act_rc, mem)
            w = np.where(over, self._span_time_rc, w)
        bad = self._empty | (mem > self.memory_limit)
        if link_in is None:
            bad |= (u != 0)[:, None]
        else:
            w = w + self._cut_s[link_in][:, None]
        if link_out is None:
            bad |= (u != n)[None, :]
        else:
            w = w + self._cut_s[link_out][None, :]
        return np.where(bad, np.inf, w)


def best_partition(costs: StageCosts, num_stages: int) -> Optional[list[tuple[int, int]]]:
    """The exact minimum-bottleneck partition into `num_stages` stages (ties: least total time),
    or None when none fits in memory (module docstring)."""
    n = costs.num_layers
    if num_stages > n:
        return None
    mats = [costs.matrices(i, num_stages) for i in range(num_stages)]
    if num_stages == 1:
        bottleneck = mats[0][0, n]
    else:  # the first stage, then the least bottleneck of the others from where it ends
        bottleneck = np.maximum(mats[0][0], costs.tail(num_stages - 1, num_stages)).min()
    if not math.isfinite(bottleneck):
        return None
    limit = bottleneck * (1 + 1e-12) + 1e-15
    total = np.full(n + 1, np.inf)
    total[0] = 0.0
    choices = []
    for w in mats:  # total[v]: least sum of stages so far, each <= the bottleneck
        cand = total[:, None] + np.where(w <= limit, w, np.inf)
        arg = cand.argmin(axis=0)
        choices.append(arg)
        total = cand[arg, np.arange(n + 1)]
    ranges = []
    v = n
    for arg in reversed(choices):
        u = int(arg[v])
        ranges.append((u, v))
        v = u
    return ranges[::-1]
