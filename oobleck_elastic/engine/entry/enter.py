"""Entering a generation (`GenerationEntry.enter`): one protocol for the first start, a join,
a drain and a failure. The worker joins the generation's process groups, one MAX all-reduce agrees
on the previous generation and the last COMMITTED step (a holder of that step's synchronised
gradients rolls forward, everyone else replays it), layers move from surviving holders
(reconfigure.py), and the stage's layers, optimizer and process groups (groups.py) are rebuilt.
Invariant: no step is applied twice or lost across an entry. It takes a `WorkerState`
(engine/step/state.py) and returns the next one. The story: docs/recovery.md.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ...config import JobConfig
from ...config.timing import entry_join_timeout
from ...logs import JobLog
from ...models import LayerModel, build_layer_model
from ...models.build import build_meta_layers
from ...models.tensor_parallel import parallelize_layer
from ...planning import Plan
from ..resilience import nccl_rules
from ..step.collectives import Collective, checked_timeout, control_group, entry_collectives
from .devices import backend_for, release_groups
from .groups import GenerationGroups, connect_groups, set_timeout
from ..step.optim import build_optimizer
from .kept_layers import copy_kept_shards, keep_layers
from .reconfigure import Identity, LayerSources, Move, Transfer, exchange, moves_of, plan_transfers, transfer_bytes
from ..step.shadows import ShadowStore
from ..step.state import WorkerState
from .shadow_seeding import keepers_by_identity, seed_store

log = JobLog(logging.getLogger(__name__))


class LayersLost(RuntimeError):
    """Some layer has no surviving copy: the job must restore a checkpoint."""

    def __init__(self, layers: list[int]) -> None:
        super().__init__(f"no surviving copy of layer(s) {layers}")
        self.layers = layers


@dataclass(frozen=True)
class Reconfiguration:
    generation: int
    """The generation entered."""
    previous: int
    """The generation left (0 at the first start)."""
    resume_step: int
    """Next step to run."""
    rolled_forward: bool
    """This worker applied the interrupted step's gradients after the failure."""
    bytes_moved: int
    """Layer bytes this worker sent plus received."""
    seconds: float
    """Wall time of the protocol on this worker."""
    lost_layers: tuple[int, ...] = ()
    """Layers without a surviving copy (then the checkpoint was restored)."""
    from_shadows: tuple[int, ...] = ()
    """Layers no surviving worker held on its devices, restored from their shadow copies."""
    shadow_bytes: int = 0
    """Bytes this worker sent plus received seeding the new plan's shadow copies."""
    donor: bool = False
    """This worker only handed its layers over (a drained node) and leaves the job."""
    moves: tuple[Move, ...] = ()
    """Every layer move of the entry, node to node (the same on every worker)."""
    sources: Optional[LayerSources] = None
    """Where the generation's layers came from (replicas, shadows; the same on every worker);
    None at the first start (layers built from the seed) and when layers were lost (the
    checkpoint restore says where they came from: engine/checkpointing.py)."""


@dataclass(frozen=True)
class Installed:
    """What `GenerationEntry.enter` installed."""

    state: WorkerState
    """The worker's state in the new generation."""
    info: Reconfiguration
    """What the entry did."""
    groups: Optional[GenerationGroups] = None
    """The new generation's process groups (None for a donor, which leaves)."""
    lost: tuple[int, ...] = ()
    """Layers with no surviving copy: the caller restores the newest checkpoint."""
    control: Optional[dist.ProcessGroup] = None
    """The entry's control group (stages and donors, engine/step/collectives.py; None for a donor)."""


def _release_donors(control: Optional[dist.ProcessGroup]) -> None:
    """One all-reduce over the entry's control group (stages and donors) after the layer exchange:
    a donor leaves only once every receiver has its layers (a process that exits with data in
    flight could reset the connection under it). Steps then run on `Trainer.step_group`, without
    the donors."""
    dist.all_reduce(torch.zeros(1, dtype=torch.float64), group=control)


class GenerationEntry:
    """The generation-entry protocol (module docstring) of one worker, identified across
    generations by (node, local rank)."""

    def __init__(
        self,
        cfg: JobConfig,
        *,
        device: torch.device,
        identity: tuple[str, int],
        timeout: timedelta,
        join_timeout: timedelta,
    ) -> None:
        self.cfg, self.device, self.identity = cfg, device, identity
        self.node = identity[0]
        self.timeout, self.join_timeout, self.base_join_timeout = timeout, join_timeout, join_timeout
        self.idle_entries = 0
        """Entries in a row with no step committed between them (`entry_join_timeout`)."""
        self._entered_at: Optional[int] = None  # the committed step at the last entry
        self._meta_layers: Optional[list[nn.Module]] = None
        self.control: Optional[dist.ProcessGroup] = None
        """The generation's control group (`_connect`): the entry's collectives, never a transfer."""

    def count_entry(self, committed_step: int) -> None:
        """An entry begins with `committed_step` steps done: count it as idle when no step was
        committed since the last entry, and set the join timeout (`entry_join_timeout`)."""
        self.idle_entries = self.idle_entries + 1 if committed_step == self._entered_at else 0
        self._entered_at = committed_step
        seconds = entry_join_timeout(
            self.base_join_timeout.total_seconds(), self.idle_entries, self.timeout.total_seconds()
        )
        self.join_timeout = timedelta(seconds=seconds)

    def enter(
        self,
        state: WorkerState,
        plan: Plan,
        store: Optional[dist.Store],
        *,
        roll_forward: Callable[[int, float], None],
        detach_kept: bool,
        load_plan: Callable[[int], Optional[Plan]] = lambda g: None,
    ) -> Installed:
        """Join generation `plan.generation` from `state`: connect, agree on the step, settle the
        interrupted step (`roll_forward(step, norm2)` applies it to `state`), agree on who holds
        what, move layers and install the new stage's layers and optimizer. `detach_kept`: a step
        of the previous generation was abandoned and may still touch its layers, so kept layers
        are copied. Returns the new state (`state` itself is not changed after the settle)."""
        t0 = time.perf_counter()
        self.count_entry(state.committed_step)
        if self.idle_entries:
            log.at(gen=plan.generation, node=self.node).info(
                "entry %d in a row with no step committed: waiting up to %.0f s to connect",
                self.idle_entries + 1,
                self.join_timeout.total_seconds(),
            )
        stage = plan.stage_at(*self.identity)
        donor = plan.donor_rank(*self.identity)
        if stage is None and donor is None:
            raise ValueError(f"{self.identity} has no stage in generation {plan.generation}")
        rank = stage.rank + (plan.lane_of(stage, self.identity[1]) or 0) if stage is not None else donor
        assert rank is not None
        self._connect(plan, rank, store)
        previous, committed = self._agree_on_step(state, self.control)
        rolled, current = self._settle(state, committed, roll_forward)
        held, shadowed = self._agree_on_layouts(state, plan, rank, current, load_plan, committed)
        transfers, lost = plan_transfers(held, plan, shadowed)
        from_shadows = tuple(sorted({t.layer for t in transfers if t.from_shadow}))
        moves: tuple[Move, ...] = ()  # what moves when nothing is lost (meta shapes built only then)
        if transfers and not lost:
            moves = moves_of(transfers, plan, self._transfer_sizes(state, plan.tensor_parallel))
        # (nobody holding anything is the first start: layers built from the seed, none lost)
        lost_layers = tuple(lost) if held else ()

        def account(moved: int, donor: bool = False, seeded: int = 0) -> Reconfiguration:
            return Reconfiguration(
                generation=plan.generation,
                previous=previous,
                resume_step=committed + 1,
                rolled_forward=rolled,
                bytes_moved=moved,
                seconds=time.perf_counter() - t0,
                donor=donor,
                moves=moves,
                lost_layers=lost_layers,
                from_shadows=from_shadows if held else (),
                shadow_bytes=seeded,
                sources=LayerSources.of_moves(plan.num_layers, moves, plan.returned)
                if held and not lost_layers
                else None,
            )

        if stage is None:
            moved = self._hand_over(state, rank, transfers, exchange_layers=not lost)
            info = account(moved, donor=True)
            log.at(gen=plan.generation, step=committed + 1, node=self.node, rank=rank).info(
                "handed layers %s over as a donor (%d layer bytes sent, %.3f s); leaving",
                state.owned,
                moved,
                info.seconds,
                event="donated",
                fields={"bytes": moved, "seconds": info.seconds},
            )
            after = WorkerState(
                layer_model=build_layer_model(
                    self.cfg.model, seed=self.cfg.training.seed, owned=[], device=str(self.device)
                ),
                plan=plan,
                generation=plan.generation,
                rank=rank,
                committed_step=committed,
                synced_step=committed,
            )
            gc.collect()
            return Installed(state=after, info=info)
        after, groups, moved = self._install(
            state, plan, rank, transfers, exchange_layers=not lost, current=current, detach_kept=detach_kept
        )
        # the new plan's shadows: kept where the keeper keeps them again, else seeded from a holder
        # (after a loss the checkpoint restore seeds them all: `seed_shadows`)
        keep = state.shadows if state.shadows is not None and state.shadows.step == committed else None
        after.shadows, seeded = self.seed_shadows(after, plan, rank, keep, shadowed, exchange_layers=not lost)
        info = account(moved, seeded=seeded)
        if info.from_shadows and rank == 0:
            log.at(gen=plan.generation, step=committed + 1, node=self.node, rank=rank).warning(
                "layers %s had no surviving device copy: taken from their shadow copies at step %d (no step lost)",
                list(info.from_shadows),
                committed + 1,
                event="from_shadows",
                fields={"layers": list(info.from_shadows), "step": committed + 1},
            )
        log.at(gen=plan.generation, step=committed + 1, node=self.node, rank=rank).info(
            "entered from generation %d (%s, %d layer bytes moved, %.3f s)",
            previous,
            "rolled forward" if rolled else "no step to roll forward",
            moved,
            info.seconds,
            event="entered",
            fields={
                "previous": previous,
                "rolled_forward": rolled,
                "bytes": moved,
                "seconds": info.seconds,
                **({"sources": info.sources.fields()} if info.sources is not None else {}),
            },
        )
        return Installed(state=after, info=info, groups=groups, lost=lost_layers, control=self.control)

    def _transfer_sizes(self, state: WorkerState, tensor_parallel: int) -> list[int]:
        """Bytes of one lane's transfer of every layer, from the layers' shapes (meta device)."""
        if self._meta_layers is None:
            self._meta_layers = build_meta_layers(
                self.cfg.model, state.layer_model.num_layers, seed=self.cfg.training.seed
            )
        return [transfer_bytes(layer, tensor_parallel) for layer in self._meta_layers]

    def _connect(self, plan: Plan, rank: int, store: Optional[dist.Store]) -> None:
        """The generation's default group (stages and donors). It connects under the short join
        timeout (a peer that died during the reconfiguration holds gloo's connection set-up for
        ~5x it); collectives then run under the comm timeout (`_agree_on_layouts` switches once
        every peer is seen). Then the control group, the generation's first (engine/step/collectives.py):
        the layer and shadow transfers run on the default group, the control collectives there."""
        self.control = None
        connect = min(self.timeout, self.join_timeout)
        release_groups(abort=False)
        nccl_rules.CHECKER.begin_generation(plan.generation)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.set_device(self.device)
            torch.cuda.empty_cache()  # the previous generation's freed blocks, before NCCL allocates
        dist.init_process_group(
            backend_for(self.device),
            store=store,
            rank=rank,
            world_size=plan.entry_world_size,
            timeout=connect,
            device_id=self.device if cuda else None,  # NCCL's world communicator made now, not lazily
        )
        nccl_rules.CHECKER.bind_world()
        self.control = control_group(plan.entry_world_size, checked_timeout(connect, self.timeout))
        connect_groups([None], self.device)  # the layer and shadow transfers' group, by every member

    @staticmethod
    def _agree_on_step(state: WorkerState, control: Optional[dist.ProcessGroup]) -> tuple[int, int]:
        """One MAX all-reduce: (newest generation anyone was in, newest step anyone committed)."""
        agree = torch.tensor([state.generation, state.committed_step, state.synced_step], dtype=torch.float64)
        dist.all_reduce(agree, op=dist.ReduceOp.MAX, group=control)
        return int(agree[0]), int(agree[1])

    @staticmethod
    def _settle(state: WorkerState, committed: int, roll_forward: Callable[[int, float], None]) -> tuple[bool, bool]:
        """Settle the interrupted step by the commit rule: a worker holding the synchronised
        gradients of the step someone committed applies them (rolls forward); anything else (a
        discarded step, possibly half a backward pass) is dropped and replayed. Returns (rolled
        forward, this worker's layers are at the agreed step)."""
        rolled = state.synced_step > state.committed_step and state.synced_step == committed
        if rolled:
            roll_forward(state.synced_step, state.synced_norm2)
        current = state.committed_step == committed
        if state.optimizer is not None:
            state.optimizer.zero_grad(set_to_none=True)
        if state.shadows is not None:
            state.shadows.discard()  # a step's gradients not applied by now never will be
        state.committed_step = state.synced_step = committed
        return rolled, current

    def _agree_on_layouts(
        self,
        state: WorkerState,
        plan: Plan,
        rank: int,
        current: bool,
        load_plan: Callable[[int], Optional[Plan]],
        committed: int,
    ) -> tuple[dict[Identity, Sequence[int]], dict[Identity, Sequence[int]]]:
        """What every worker of `plan`'s entry (stages and donors) really holds: the layers of its
        stage in the generation it last entered (not always the previous one: an entry may have
        failed half-way on some workers), or nothing (new, restarted, or behind the agreed step);
        and the layers whose shadow copies it keeps current (at `committed`), by the plan that
        placed them. One all-reduce of generations; every copy is at the same committed step, so
        any is a source."""
        held = torch.zeros(2, plan.entry_world_size, dtype=torch.float64)
        held[0, rank] = state.generation if state.owned and current else 0
        shadows = state.shadows
        if shadows is not None:
            shadows.settle()
        if shadows is not None and shadows.layers and shadows.step == committed:
            held[1, rank] = shadows.generation
        dist.all_reduce(held, group=self.control)
        set_timeout(self.timeout, [self.control])  # every peer is connected now: the default group and the control one
        layouts = {int(g) for g in held.reshape(-1).tolist() if g > 0}
        plans = {
            g: state.plan if state.plan is not None and state.plan.generation == g else load_plan(g) for g in layouts
        }
        missing = sorted(g for g, p in plans.items() if p is None)
        if missing:
            raise RuntimeError(f"plan(s) of generation(s) {missing} are not available to {self.identity}")
        found = {g: p for g, p in plans.items() if p is not None}
        ranks = plan.entry_ranks()
        # each generation's layouts once, not once per worker that entered it
        stage_layers = {g: p.layers_by_worker() for g, p in found.items()}
        shadow_layers = {g: keepers_by_identity(p) for g, p in found.items()}
        layers = {
            ident: stage_layers[int(held[0, r])].get(ident, range(0))
            for ident, r in ranks.items()
            if int(held[0, r]) > 0
        }
        kept: dict[Identity, Sequence[int]] = {
            ident: shadow_layers[int(held[1, r])].get(ident, []) for ident, r in ranks.items() if int(held[1, r]) > 0
        }
        return layers, kept

    def seed_shadows(
        self,
        state: WorkerState,
        plan: Plan,
        rank: int,
        keep: Optional[ShadowStore],
        kept: dict[Identity, Sequence[int]],
        *,
        exchange_layers: bool = True,
    ) -> tuple[Optional[ShadowStore], int]:
        """This worker's store of `plan`'s shadow copies, `state` being its stage in `plan`
        (shadow_seeding.py `seed_store`)."""
        return seed_store(
            self.cfg,
            identity=self.identity,
            device=self.device,
            layer_model=state.layer_model,
            optimizer=state.optimizer,
            step=state.committed_step,
            plan=plan,
            rank=rank,
            keep=keep,
            kept=kept,
            exchange_layers=exchange_layers,
        )

    def _install(
        self,
        state: WorkerState,
        plan: Plan,
        rank: int,
        transfers: list[Transfer],
        *,
        exchange_layers: bool,
        current: bool,
        detach_kept: bool,
    ) -> tuple[WorkerState, GenerationGroups, int]:
        """Build the stage's layers: kept ones stay (copies after an abandoned step), received ones
        are allocated and filled by the transfer with their optimizer state, others are built from
        the seed (or read from the pretrained directory); then a new optimizer. With tensor
        parallelism every layer is built again and sharded over the new generation's lanes, and a
        kept layer's shards and optimizer state are copied into it. Returns the new state, the
        generation's groups and the layer bytes this worker sent plus received."""
        stage = plan.stage_of(rank)[1]
        owned = list(stage.layers())  # with chunks: every virtual stage's layers
        kept = [i for i in owned if i in state.owned] if current else []
        groups = GenerationGroups(
            plan,
            state.layer_model,
            rank=rank,
            timeout=self.timeout,
            connect_timeout=self.join_timeout,
            device_type=self.device.type,
        )
        connect_groups(groups.ordered, self.device)
        if nccl_rules.CHECKER.active:
            log.at(gen=plan.generation, node=self.node, rank=rank).info(nccl_rules.CHECKER.summary())
        sharded = groups.mesh is not None
        fresh = owned if sharded else [i for i in owned if i not in kept]
        # layers about to be received are only allocated: their values come with the transfer
        incoming = {t.layer for t in transfers if t.dst == rank} if exchange_layers else set()
        target = build_layer_model(
            self.cfg.model, seed=self.cfg.training.seed, owned=fresh, device=str(self.device), empty=incoming
        )
        old_state = state.optimizer.state if state.optimizer is not None else {}
        if sharded:
            assert groups.mesh is not None
            for i in owned:
                parallelize_layer(target.held(i), groups.mesh)
            keep_state = {
                id(new): (new, st) for new, st in copy_kept_shards(state.layer_model, kept, target, old_state)
            }
        else:
            kept_layers, kept_params = keep_layers(state.layer_model, kept, detach=detach_kept)
            for i in kept:
                target.layers[i] = kept_layers[i]
            target.retie()
            keep_state = {
                id(new): (new, {k: v.clone() if new is not old else v for k, v in old_state[old].items()})
                for old, new in kept_params
                if old in old_state
            }
        states: dict[int, tuple[nn.Parameter, dict[str, torch.Tensor]]] = {}
        moved = 0
        if exchange_layers:
            states, moved = exchange(
                transfers,
                rank=rank,
                source=state.layer_model,
                optimizer=state.optimizer,
                target=target,
                shadow=_shadow_source(state),
                device=self.device,
            )
        if Collective.RELEASE_DONORS in entry_collectives(plan):
            _release_donors(self.control)
        params = list(dict.fromkeys(p for i in owned for p in target.held(i).parameters()))
        optimizer = build_optimizer(params, self.cfg.training)
        ours = {id(p) for p in params}
        for p, st in {**keep_state, **states}.values():
            if id(p) in ours:
                optimizer.state[p] = st
        after = WorkerState(
            layer_model=target,
            owned=owned,
            optimizer=optimizer,
            plan=plan,
            generation=plan.generation,
            rank=rank,
            committed_step=state.committed_step,
            synced_step=state.synced_step,
            params=params,
            max_loss=state.max_loss,
        )
        return after, groups, moved

    def _hand_over(self, state: WorkerState, rank: int, transfers: list[Transfer], *, exchange_layers: bool) -> int:
        """A donor's part of the entry: send the layers (with their optimizer state) the plan's
        stages need from it, then leave the generation. Returns the bytes sent."""
        moved = 0
        if exchange_layers:
            _, moved = exchange(
                transfers,
                rank=rank,
                source=state.layer_model,
                optimizer=state.optimizer,
                target=state.layer_model,
                shadow=_shadow_source(state),
                device=self.device,
            )
        _release_donors(self.control)
        self.control = None
        release_groups(abort=False)
        return moved


def _shadow_source(state: WorkerState) -> Optional[tuple[LayerModel, Optional[torch.optim.Optimizer]]]:
    """The shadow copies `state` keeps, as a source of layer transfers."""
    if state.shadows is None:
        return None
    state.shadows.settle()
    return state.shadows.layer_model, state.shadows.optimizer
