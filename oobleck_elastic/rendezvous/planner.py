"""The leader's planner: plans from the job's profile, which the first leader to plan pins in etcd.

Invariant: every leader of a job plans from the same pinned profile, so the tensor-parallel
degree never changes during the job. The story: docs/planning.md.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Optional

from ..config import JobConfig
from ..etcd import EtcdClient
from ..logs import JobLog
from ..planning import (
    MicrobatchError,
    ModelProfile,
    Plan,
    PlanningError,
    ProfileError,
    choose_tensor_parallel,
    load_profiles,
    plan_job,
    templates_for,
    with_shadows,
)
from ..planning.fleet import class_templates, fleet_plan, fleet_templates
from ..planning.profile.profile import recompute_mismatch
from ..planning.tolerance.shadows import SHADOWS_WITH_TP
from ..records.keys import Keys
from .leader import JobUnplannable
from .membership import live_nodes

log = JobLog(logging.getLogger(__name__))

__all__ = ["JobPlanner"]


class JobPlanner:
    """The planner of one job's leader (docs/planning.md)."""

    def __init__(self, cfg: JobConfig, client: EtcdClient, keys: Keys) -> None:
        self.cfg, self.client, self.keys = cfg, client, keys
        self._templates: Any = None
        self._schedules: Any = None  # the schedule chooser of _templates, with its simulations cached
        self._pinned: ModelProfile | None = None
        self._warned: set[tuple[str, int]] = set()  # (key, mod revision) of values already reported
        self._class_templates: dict[str, Any] = {}  # a mixed fleet's templates by class, built once

    @property
    def pinned(self) -> ModelProfile | None:
        """The profile this leader plans from, once it has read or pinned one."""
        return self._pinned

    def plan_for(self, nodes: list[str], generation: int, previous: Optional[Plan] = None) -> Plan:
        """The planner the leader calls: templates from the job's profile (pinned in etcd);
        nodes keep as many of the layers they hold in `previous` as the new plan allows. With
        training.microbatch_size=auto the size is chosen once: the current plan's when there is
        one (a new leader keeps it), else the best for planning.max_nodes or these nodes. With
        device classes (planning.classes), each node's class is read from its record and the
        fleet is planned class by class (`planning.fleet`)."""
        if self.cfg.planning.classes:
            return self._plan_fleet(nodes, generation, previous)
        if self._templates is None:
            profile = self._profile(len(nodes))
            try:
                self._templates = templates_for(
                    self.cfg, profile, len(nodes), microbatch_size=previous.microbatch_size if previous else None
                )
            except MicrobatchError as err:
                if err.memory_bound or self.cfg.planning.max_nodes:  # no other node count is tried
                    raise JobUnplannable(str(err)) from None
                raise  # no size can be planned on these nodes yet: wait for more
            except PlanningError as err:  # the config and the pinned profile are fixed: no node count helps
                raise JobUnplannable(str(err)) from None
        reuse = (
            self._schedules if self._schedules is not None and self._schedules.templates is self._templates else None
        )
        jp = plan_job(
            self.cfg,
            nodes=nodes,
            generation=generation,
            templates=self._templates,
            previous=previous,
            engine_only=True,
            schedules=reuse,  # a re-plan does not simulate again what an earlier plan did
        )
        self._schedules = jp.schedules
        copies = self.cfg.fault_tolerance.shadow_copies
        if copies and jp.plan.tensor_parallel > 1:
            raise JobUnplannable(SHADOWS_WITH_TP.format(copies=copies))
        if copies:  # host-memory shadow copies of every layer (planning/tolerance/shadows.py), as many as fit
            return with_shadows(self.cfg, jp.plan, self._profile(len(nodes)), fewer=True)
        return jp.plan

    def _plan_fleet(self, nodes: list[str], generation: int, previous: Optional[Plan]) -> Plan:
        """A mixed fleet's plan: the nodes grouped by the class their records declare."""
        if self.cfg.fault_tolerance.shadow_copies:
            raise JobUnplannable("fault_tolerance.shadow_copies with device classes: not planned yet; set it to 0")
        declared = {rec.node_id: rec.device_class for rec in live_nodes(self.client, self.keys)}
        by_class: dict[str, list[str]] = {c: [] for c in self.cfg.planning.classes}
        for n in nodes:
            c = declared.get(n, "")
            if c not in by_class:
                raise PlanningError(f"node {n} declares device class {c!r}, not one of planning.classes")
            by_class[c].append(n)
        by_class = {c: ids for c, ids in by_class.items() if ids}
        profile = self._profile(len(nodes))
        try:
            for c in by_class:
                if c not in self._class_templates:
                    self._class_templates[c] = class_templates(self.cfg, c, {profile.tensor_parallel: profile})
            ft = fleet_templates(self.cfg, {c: len(ids) for c, ids in by_class.items()}, {}, self._class_templates)
        except PlanningError as err:  # the config and the pinned profile are fixed: no node count helps
            raise JobUnplannable(str(err)) from None
        return fleet_plan(self.cfg, by_class, ft, generation=generation, previous=previous)

    def profile_ready(self) -> bool:
        """Whether the planner has its profile now (the leader publishes no first plan before):
        always with planning.profile_path, else once one is pinned or a worker published one."""
        if self.cfg.planning.profile_path or self._pinned is not None:
            return True
        return self._pinned_or_measured() is not None

    def _profile(self, nodes: int) -> ModelProfile:
        """The profile every leader plans from: the one pinned in etcd, else planning.profile_path
        (with `{tp}` in it and tensor_parallel=auto: the degree best for planning.max_nodes or
        `nodes` nodes), else the first worker-measured one; whichever is used first is pinned for
        all later leaders, so the degree never changes during the job."""
        try:
            if self.cfg.planning.profile_path and self._pinned is None and self._read_pinned() is None:
                profiles = load_profiles(self.cfg)
                degree = (
                    choose_tensor_parallel(self.cfg, profiles, self.cfg.planning.max_nodes or nodes)
                    if len(profiles) > 1
                    else next(iter(profiles))
                )
                self._pin(profiles[degree])
            profile = self._pinned_or_measured()
        except ProfileError as err:
            raise PlanningError(str(err)) from None
        if profile is None:
            raise PlanningError(
                "no profile to plan from yet: no worker has published the profile of its device "
                "(workers call WorkerContext.share_profile before they report ready)"
            )
        return profile

    def _pinned_or_measured(self) -> ModelProfile | None:
        """The pinned profile, or pin the first valid worker-measured one; None when there is none."""
        if self._pinned is not None or self._read_pinned() is not None:
            return self._pinned
        candidates = []
        for kv in self.client.range(self.keys.profiles)[1]:
            profile = self._valid(kv.key, kv.value, kv.mod_revision, of_this_job=True)
            if profile is not None:
                candidates.append((kv.create_revision, kv.key, profile))
        if not candidates:
            return None
        candidates.sort(key=lambda c: c[0])
        _, key, profile = candidates[0]
        if len(candidates) > 1 and (key, -1) not in self._warned:
            self._warned.add((key, -1))
            log.warning(
                "workers published profiles of %d device kinds (%s): planning with %s, the first one; the "
                "planner assumes every device is of one kind",
                len(candidates),
                ", ".join(self.keys.node_of(k) for _, k, _ in candidates),
                self.keys.node_of(key),
            )
        return self._pin(profile)

    def _pin(self, profile: ModelProfile) -> ModelProfile | None:
        """Put `profile` under `profile` unless one is there already; return whichever is pinned."""
        self.client.put_if_absent(self.keys.profile, json.dumps(profile.to_json()))
        return self._read_pinned()

    def _read_pinned(self) -> ModelProfile | None:
        if self._pinned is None:
            kv = self.client.get(self.keys.profile)
            if kv is not None:
                self._pinned = self._valid(self.keys.profile, kv.value, kv.mod_revision)
        return self._pinned

    def _valid(self, key: str, value: bytes, revision: int, *, of_this_job: bool = False) -> ModelProfile | None:
        """A profile read from etcd, validated (JSON and schema; with `of_this_job`, also the job's
        layer count, microbatch shape and precision: a worker-measured profile must match the config,
        while the pinned one is trusted as a leader chose it, also a planning.profile_path file);
        None, with one warning per key and revision, when it is malformed or for another job."""
        try:
            try:
                data = json.loads(value)
            except (ValueError, UnicodeDecodeError) as err:
                raise ProfileError(f"not valid JSON ({err})") from None
            profile = ModelProfile.from_json(data, source=key)
            if not of_this_job:
                return profile
            m, t = self.cfg.model, self.cfg.training
            expected = m.num_layers + 2
            if m.family != "custom" and not m.pretrained_path and profile.num_layers != expected:
                raise ProfileError(f"{profile.num_layers} layers but model.num_layers={m.num_layers} gives {expected}")
            # with training.microbatch_size auto, the key says "auto" (and the sizes measured): the
            # size itself is the planner's to choose from it, and the plan carries it to the workers
            for name, want in (
                ("microbatch_size", t.microbatch_size),
                ("seq_len", self.cfg.data.seq_len),
                ("precision", t.precision),
            ):
                if name in profile.key and profile.key[name] != want:
                    raise ProfileError(f"measured with {name}={profile.key[name]!r} but the job has {want!r}")
            if why := recompute_mismatch(self.cfg, profile, key):  # no numbers for the job's mode
                raise ProfileError(why)
            return profile
        except ProfileError as err:
            if (key, revision) not in self._warned:
                self._warned.add((key, revision))
                log.warning("ignoring profile in etcd key %s: %s", key, err)
            return None
