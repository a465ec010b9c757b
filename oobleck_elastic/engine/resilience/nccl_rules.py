"""NCCL's rules for a generation's communicators, checked on any backend (`OOBLECK_NCCL_RULES=1`).

NCCL builds a group's communicator at its first operation, with every member taking part; a
group first used by some of its members (point-to-point), from autograd's thread or inside a step
could hang or allocate at peak memory. So the entry connects every device group (data plane:
layer transfers, pipeline, lanes, holder sets) with all its members, in one order
(engine/entry/groups.py `connect_groups`); host groups (control, step, shadow link: CPU tensors,
gloo on every device) are exempt (`host_group`). The checker wraps torch.distributed's calls,
records each device group's first use and raises `NcclRuleBroken` at one made anywhere else
than in that connect. docs/nccl.md.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d

from ...logs import JobLog

__all__ = ["RULES_ENV", "FirstUse", "NcclRuleBroken", "broken_rule", "connecting", "host_group", "install", "CHECKER"]

log = JobLog(logging.getLogger(__name__))

RULES_ENV = "OOBLECK_NCCL_RULES"
"""`1`: check NCCL's rules in this process, on any backend (the multi-process tests set it)."""

COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "barrier",
)
"""torch.distributed's collectives: every member of the group takes part."""
POINT_TO_POINT = ("send", "recv", "isend", "irecv", "batch_isend_irecv")
"""torch.distributed's point-to-point calls: two members of the group take part."""
FUNCTIONAL = ("all_reduce", "all_gather_tensor", "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single")
"""The functional collectives DTensor issues (tensor parallelism)."""


class NcclRuleBroken(RuntimeError):
    """A device group was first used where NCCL would hang or allocate late (module docstring)."""


@dataclass(frozen=True)
class FirstUse:
    """A device group's first data-plane operation in this process."""

    group: str
    """The group's name in this generation."""
    ranks: tuple[int, ...]
    """Its members (global ranks of the generation)."""
    op: str
    """The call, e.g. `all_reduce` or `batch_isend_irecv`."""
    point_to_point: bool
    """Made by two of the group's members, not all of them."""
    thread: str
    """The thread that made it."""
    connecting: bool
    """Made inside the entry's connect (`connecting`)."""


def broken_rule(use: FirstUse) -> Optional[str]:
    """What `use` breaks, or None: a device group's first operation must be a collective of all
    its members made in the entry's connect (not a point-to-point call of some of them, not a call
    from the step, its hooks or any other thread)."""
    where = f"group {use.group} (ranks {list(use.ranks)}) was first used by {use.op} on thread {use.thread}"
    if use.point_to_point and len(use.ranks) > 2:
        return f"{where}: point-to-point, so by some of its ranks (NCCL needs every member at its first call)"
    if not use.connecting:
        return f"{where}, not in the entry's connect (NCCL would create its communicator there, late and blocking)"
    if use.point_to_point:
        return f"{where}: point-to-point, not a collective of the group (the entry connects with an all-reduce)"
    return None


class Checker:
    """This process's record of the current generation's first uses (module docstring)."""

    def __init__(self) -> None:
        self.active = False
        """The calls are wrapped (`install`)."""
        self.generation = 0
        """The generation whose groups are recorded."""
        self.first: dict[int, FirstUse] = {}
        """id(group) -> its first use in this generation."""
        self.host: set[int] = set()
        """id(group) of this generation's host groups (exempt)."""
        self.world: Optional[weakref.ref[dist.ProcessGroup]] = None
        """The generation's default group (weakly: a gloo group closes its sockets only when its last
        reference goes); calls are checked only while it is the default group, so a process that
        later makes worlds of its own (a test) is left alone."""
        self._local = threading.local()
        self._lock = threading.Lock()

    def begin_generation(self, generation: int) -> None:
        """Forget the previous generation's groups (their ids may be reused by the new ones)."""
        with self._lock:
            self.generation, self.first, self.host, self.world = generation, {}, set(), None

    def bind_world(self) -> None:
        """The default group just made is the generation's (`begin_generation` came first)."""
        pg = c10d._world.default_pg
        self.world = weakref.ref(pg) if pg is not None else None

    def host_group(self, group: Optional[dist.ProcessGroup]) -> None:
        if group is not None:
            self.host.add(id(group))

    @contextlib.contextmanager
    def connecting(self) -> Iterator[None]:
        previous = getattr(self._local, "connecting", False)
        self._local.connecting = True
        try:
            yield
        finally:
            self._local.connecting = previous

    def record(self, op: str, group: Optional[dist.ProcessGroup], *, point_to_point: bool) -> None:
        """A call `op` on `group` (None: the default group) is about to be made."""
        world = c10d._world.default_pg
        if world is None or self.world is None or self.world() is not world:
            return
        pg = group if group is not None else world
        if id(pg) in self.first or id(pg) in self.host:
            return
        use = FirstUse(
            group=getattr(pg, "group_name", "?"),
            ranks=tuple(dist.get_process_group_ranks(pg)),
            op=op,
            point_to_point=point_to_point,
            thread=threading.current_thread().name,
            connecting=getattr(self._local, "connecting", False),
        )
        with self._lock:
            if id(pg) in self.first:
                return
            self.first[id(pg)] = use
        broken = broken_rule(use)
        if broken is not None:
            raise NcclRuleBroken(f"NCCL rules ({RULES_ENV}=1), generation {self.generation}: {broken}")

    def summary(self) -> str:
        """One line naming the rules and the device groups checked so far in this generation."""
        names = ", ".join(f"{u.group}{list(u.ranks)}" for u in self.first.values())
        return (
            f"NCCL rules checked ({RULES_ENV}=1): {len(self.first)} device group(s) of generation "
            f"{self.generation} first used by all their members in the entry's connect: {names}"
        )


CHECKER = Checker()
"""The process's checker (one per worker process)."""


def connecting() -> contextlib.AbstractContextManager[None]:
    """The calls made inside are the entry's connect (engine/entry/groups.py `connect_groups`)."""
    return CHECKER.connecting()


def host_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """Mark `group` as a host group (CPU tensors only: gloo on every device), exempt from the
    rules; returns it."""
    CHECKER.host_group(group)
    return group


def install(environ: Optional[dict[str, str]] = None) -> bool:
    """Wrap torch.distributed's calls when `RULES_ENV` is `1` in `environ` (default: the
    process's); once per process, before any point-to-point op is built (`dist.P2POp` compares its
    function with torch's own `isend`/`irecv`, so both names are replaced alike). Returns whether
    the checker is on."""
    env = os.environ if environ is None else environ
    if CHECKER.active or env.get(RULES_ENV, "").strip() != "1":
        return CHECKER.active
    for name in COLLECTIVES + POINT_TO_POINT:
        wrapped = _wrap(getattr(c10d, name), name, point_to_point=name in POINT_TO_POINT)
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is not None:
            setattr(dist, name, wrapped)
    for name in FUNCTIONAL:
        if hasattr(funcol, name):
            setattr(funcol, name, _wrap(getattr(funcol, name), name, point_to_point=False, functional=True))
    CHECKER.active = True
    return True


def _wrap(fn: Callable[..., Any], name: str, *, point_to_point: bool, functional: bool = False) -> Callable[..., Any]:
    position = _group_position(inspect.signature(fn))

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        CHECKER.record(name, _group_of(name, position, args, kwargs, functional), point_to_point=point_to_point)
        return fn(*args, **kwargs)

    return call


def _group_position(signature: inspect.Signature) -> Optional[int]:
    """Where a call passes `group` by position (None: only by keyword, or not a parameter)."""
    for i, parameter in enumerate(signature.parameters.values()):
        if parameter.name == "group":
            return i if parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD else None
    return None


def _group_of(
    name: str, position: Optional[int], args: tuple[Any, ...], kwargs: dict[str, Any], functional: bool
) -> Optional[dist.ProcessGroup]:
    if name == "batch_isend_irecv":
        ops = args[0] if args else kwargs.get("p2p_op_list", [])
        return ops[0].group if ops else None
    if "group" in kwargs:
        group = kwargs["group"]
    else:
        group = args[position] if position is not None and position < len(args) else None
    if functional:  # a group, a mesh, (mesh, dim), ranks or a name
        return c10d._resolve_process_group(funcol._resolve_group_name(group))
    return group
