"""`--kill` and `--preempt` targets of the local launcher: a launcher number, a node id or a role,
parsed from the command line and resolved against what etcd has told of the nodes (`Roles`).
The story: docs/running.md."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

__all__ = ["ROLES", "Roles", "parse_at", "parse_preempt", "resolve"]


ROLES = ("leader", "rank0", "follower")
"""`--kill`/`--preempt` targets by role: the leader's node, the node of rank 0, or a node that is
neither (the first such in launcher order)."""


def parse_at(value: str) -> tuple[int | str, int]:
    """TARGET@STEP: TARGET a launcher number (`2`, as an int), a node id (`node2`) or a role (ROLES)."""
    node, _, step = value.partition("@")
    if not (node.isdigit() or node in ROLES or (node.startswith("node") and node[4:].isdigit())) or not step.isdigit():
        raise argparse.ArgumentTypeError(
            f"'{value}' is not NODE@STEP: NODE a launcher number (2), a node id (node2) or one of "
            f"{', '.join(ROLES)}; STEP a step (e.g. 2@5, leader@5)"
        )
    return (int(node) if node.isdigit() else node), int(step)


def parse_preempt(value: str) -> tuple[int | str, int, float]:
    at, _, grace = value.partition(":")
    node, step = parse_at(at)
    try:
        seconds = float(grace) if grace else 60.0
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"'{value}' is not NODE@STEP[:GRACE] with GRACE > 0 seconds (e.g. 1@5:30)")
    return node, step, seconds


@dataclass(frozen=True)
class Roles:
    """What the launcher knows of its nodes from etcd: node ids by launcher number, the leader's
    and rank 0's node ids (None: not known yet)."""

    ids: Mapping[int, str]
    leader: Optional[str] = None
    rank0: Optional[str] = None

    def describe(self, number: int) -> str:
        """`node2`, `node2, the leader`, `node0, the leader and rank 0`, or `` when not known."""
        node = self.ids.get(number)
        if node is None:
            return ""
        roles = [r for r, holder in (("the leader", self.leader), ("rank 0", self.rank0)) if holder == node]
        return node + (", " + " and ".join(roles) if roles else "")


def resolve(target: int | str, live: Sequence[int], roles: Roles) -> tuple[Optional[int], str, bool]:
    """(the launcher number `target` names among the `live` nodes (launcher numbers, in order) or
    None, why not, whether to ask again later): a number names that node; a node id or a role, the
    node that holds it now. Later: the role's holder is not known yet, or a live node's id is not
    (it may be the one named)."""
    if isinstance(target, int):
        return (target, "", False) if target in live else (None, f"there is no running node {target}", False)
    unlabelled = any(n not in roles.ids for n in live)
    if target == "follower":
        if roles.leader is None or roles.rank0 is None or unlabelled:
            return None, "the leader, rank 0 or a node's id is not known yet", True
        free = [n for n in live if roles.ids[n] not in (roles.leader, roles.rank0)]
        return (free[0], "", False) if free else (None, "every running node is the leader or rank 0", False)
    node = {"leader": roles.leader, "rank0": roles.rank0}.get(target, target)
    if node is None:
        return None, f"the {target} is not known yet", True
    by_id = {roles.ids[n]: n for n in live if n in roles.ids}
    if node in by_id:
        return by_id[node], "", False
    return None, f"no running node is {node}{' yet' if unlabelled else ''}", unlabelled
