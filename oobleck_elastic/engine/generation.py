"""Entering a generation: the part of the trainer that joins a plan's workers and installs its stage.

A worker enters a generation (`GenerationEntry.enter_generation`, the same protocol for the
first start, a join, a drain and a failure): it joins the generation's default process group
(the workers of its stages, plus those of its donors: drained nodes that only hand their layers
over, then leave; steps then run on `Trainer.step_group`, the stages alone), and one MAX
all-reduce tells everyone the previous generation and the last step anyone COMMITTED. A worker
holding synchronised gradients of that step which it had not yet applied rolls forward (applies
them); otherwise an interrupted step is discarded and replayed (docs/design.md, invariant 2).
Then layers move from surviving holders (reconfigure.py), and the stage, the schedule and the
groups of groups.py are rebuilt; with tensor parallelism every layer of the stage is built
again, sharded over the new generation's lanes, and kept layers' shards are copied in.

`GenerationEntry` is a mixin of `Trainer` (engine/trainer.py): it uses the trainer's state
(layer model, optimizer, owned layers, committed step) and its `_adopt` / `_build_pipeline`.
"""

from __future__ import annotations

import copy
import gc
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import _set_pg_timeout
from torch.distributed.tensor import DTensor

from ..models import LayerModel, build_layer_model
from ..models.build import build_meta_layers
from ..models.tensor_parallel import from_full, local, parallelize_layer, wrap_like
from ..planning import Plan
from .devices import backend_for, release_groups
from .groups import GenerationGroups
from .reconfigure import Identity, Move, Transfer, exchange, moves_of, plan_transfers, retie, transfer_bytes

log = logging.getLogger(__name__)


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
    donor: bool = False
    """This worker only handed its layers over (a drained node) and leaves the job."""
    moves: tuple[Move, ...] = ()
    """Every layer move of the entry, node to node (the same on every worker)."""


def _release_donors() -> None:
    """One all-reduce over the entry (stages and donors) after the layer exchange: a donor leaves
    only once every receiver has its layers (a process that exits with data in flight could reset
    the connection under it). Steps then run on `Trainer.step_group`, without the donors."""
    dist.all_reduce(torch.zeros(1, dtype=torch.float64))


def _shard_of(layer: nn.Module, name: str, t: torch.Tensor) -> torch.Tensor:
    """This lane's part of `t` (a kept shard as it is; a whole tensor, e.g. of a layer built
    whole before the first generation, cut like parameter `name` of `layer`)."""
    return local(t) if isinstance(t, DTensor) else from_full(layer, name, t)


class GenerationEntry:
    """The generation-entry protocol of `Trainer` (module docstring)."""

    def enter_generation(self, plan: Plan, store: Optional[dist.Store], *,
                         load_plan: Callable[[int], Optional[Plan]] = lambda g: None) -> Reconfiguration:
        """Join generation `plan.generation` (see the module docstring): connect, agree on the
        step, settle the interrupted step, agree on who holds what, move layers and install the
        new stage. Raises LayersLost when a layer has no surviving copy (the caller restores the
        newest checkpoint)."""
        t0 = time.perf_counter()
        stage = plan.stage_at(*self.identity)
        donor = plan.donor_rank(*self.identity)
        if stage is None and donor is None:
            raise ValueError(f"{self.identity} has no stage in generation {plan.generation}")
        rank = stage.rank + (plan.lane_of(stage, self.identity[1]) or 0) if stage is not None else donor
        assert rank is not None
        self._connect(plan, rank, store)
        previous, committed = self._agree_on_step()
        rolled, current = self._settle(committed)
        held = self._agree_on_layouts(plan, rank, current, load_plan)
        transfers, lost = plan_transfers(held, plan)
        moves = moves_of(transfers, plan, self._transfer_sizes(plan.tensor_parallel)) if transfers and not lost else ()
        if stage is None:
            gave = list(self.owned)
            moved = self._hand_over(plan, rank, transfers, exchange_layers=not lost)
            info = Reconfiguration(generation=plan.generation, previous=previous, resume_step=committed + 1,
                                   rolled_forward=rolled, bytes_moved=moved, seconds=time.perf_counter() - t0,
                                   donor=True, moves=moves)
            log.info("gen %d step %d node %s rank %d: handed layers %s over as a donor (%d layer bytes sent, "
                     "%.3f s); leaving", plan.generation, committed + 1, self.node, rank, gave, moved,
                     info.seconds)
            return info
        moved = self._install(plan, rank, transfers, exchange_layers=not lost, current=current)
        if lost and held:  # (nobody holding anything is the first start: layers built from the seed)
            raise LayersLost(lost)
        info = Reconfiguration(generation=plan.generation, previous=previous, resume_step=committed + 1,
                               rolled_forward=rolled, bytes_moved=moved, seconds=time.perf_counter() - t0,
                               moves=moves)
        log.info("gen %d step %d node %s rank %d: entered from generation %d (%s, %d layer bytes moved, %.3f s)",
                 plan.generation, committed + 1, self.node, rank, previous,
                 "rolled forward" if rolled else "no step to roll forward", moved, info.seconds)
        return info

    def _transfer_sizes(self, tensor_parallel: int) -> list[int]:
        """Bytes of one lane's transfer of every layer, from the layers' shapes (meta device)."""
        if getattr(self, "_meta_layers", None) is None:
            self._meta_layers = build_meta_layers(self.cfg.model, self.layer_model.num_layers,
                                                  seed=self.cfg.training.seed)
        return [transfer_bytes(layer, tensor_parallel) for layer in self._meta_layers]

    def _connect(self, plan: Plan, rank: int, store: Optional[dist.Store]) -> None:
        """The generation's default group (stages and donors). It connects under the short join
        timeout (a peer that died during the reconfiguration holds gloo's connection set-up for
        ~5x it); collectives then run under the comm timeout (`_agree_on_layouts` switches once
        every peer is seen)."""
        release_groups(abort=False)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(backend_for(self.device), store=store, rank=rank,
                                world_size=plan.entry_world_size, timeout=min(self.timeout, self.join_timeout))

    def _agree_on_step(self) -> tuple[int, int]:
        """One MAX all-reduce: (newest generation anyone was in, newest step anyone committed)."""
        agree = torch.tensor([self.generation, self.committed_step, self.synced_step], dtype=torch.float64)
        dist.all_reduce(agree, op=dist.ReduceOp.MAX)
        return int(agree[0]), int(agree[1])

    def _settle(self, committed: int) -> tuple[bool, bool]:
        """Settle the interrupted step by the commit rule: a worker holding the synchronised
        gradients of the step someone committed applies them (rolls forward); anything else (a
        discarded step, possibly half a backward pass) is dropped and replayed. Returns (rolled
        forward, this worker's layers are at the agreed step)."""
        rolled = self.synced_step > self.committed_step and self.synced_step == committed
        if rolled:
            self._apply(self.synced_step, self._synced_norm2)
        current = self.committed_step == committed
        self._zero_grad()
        self.committed_step = self.synced_step = committed
        return rolled, current

    def _agree_on_layouts(self, plan: Plan, rank: int, current: bool,
                          load_plan: Callable[[int], Optional[Plan]]) -> dict[Identity, range]:
        """What every worker of `plan`'s entry (stages and donors) really holds: the layers of its
        stage in the generation it last entered (not always the previous one: an entry may have
        failed half-way on some workers), or nothing (new, restarted, or behind the agreed step).
        One all-reduce of generations; every copy is at the same committed step, so any is a source."""
        held = torch.zeros(plan.entry_world_size, dtype=torch.float64)
        held[rank] = self.generation if self.owned and current else 0
        dist.all_reduce(held)
        _set_pg_timeout(self.timeout)  # every peer is connected now
        layouts = {int(g) for g in held.tolist() if g > 0}
        plans = {g: self.plan if self.plan is not None and self.plan.generation == g else load_plan(g) for g in layouts}
        missing = sorted(g for g, p in plans.items() if p is None)
        if missing:
            raise RuntimeError(f"plan(s) of generation(s) {missing} are not available to {self.identity}")
        return {ident: plans[int(held[r])].layers_by_worker().get(ident, range(0))
                for ident, r in plan.entry_ranks().items() if int(held[r]) > 0}

    def _install(self, plan: Plan, rank: int, transfers: list[Transfer], *, exchange_layers: bool,
                 current: bool) -> int:
        """Build the stage's layers: kept ones stay (copies after an abandoned step), received ones
        come with their optimizer state, others are built from the seed; then a new optimizer and
        the pipeline. With tensor parallelism every layer is built again and sharded over the new
        generation's lanes, and a kept layer's shards and optimizer state are copied into it.
        Returns the layer bytes this worker sent plus received."""
        stage = plan.stage_of(rank)[1]
        owned = list(range(stage.start, stage.end))
        kept = [i for i in owned if i in self.owned] if current else []
        groups = GenerationGroups(plan, self.layer_model, rank=rank, timeout=self.timeout,
                                  connect_timeout=self.join_timeout, device_type=self.device.type)
        sharded = groups.mesh is not None
        fresh = owned if sharded else [i for i in owned if i not in kept]
        target = build_layer_model(self.cfg.model, seed=self.cfg.training.seed, owned=fresh, device=str(self.device))
        old_state = self.optimizer.state if self.optimizer is not None else {}
        if sharded:
            for i in owned:
                parallelize_layer(target.layers[i], groups.mesh)
            keep_state = {id(new): (new, state) for new, state in self._copy_kept_shards(kept, target, old_state)}
        else:
            kept_layers, kept_params = self._kept_layers(kept)
            for i in kept:
                target.layers[i] = kept_layers[i]
            retie(target)
            keep_state = {id(new): (new, {k: v.clone() if new is not old else v for k, v in old_state[old].items()})
                          for old, new in kept_params if old in old_state}
        states, moved = ({}, 0)
        if exchange_layers:
            states, moved = exchange(transfers, rank=rank, source=self.layer_model, optimizer=self.optimizer,
                                     target=target)
        if plan.donors:
            _release_donors()
        self._detach_kept = False
        self.layer_model, self.plan, self.generation, self.rank = target, plan, plan.generation, rank
        self.groups = groups
        self._adopt(owned, {**keep_state, **states})
        self._build_pipeline(plan)
        return moved

    def _copy_kept_shards(self, kept: list[int], target: LayerModel, old_state: dict[Any, dict[str, Any]]
                          ) -> Iterator[tuple[nn.Parameter, dict[str, torch.Tensor]]]:
        """Copy this lane's shards of the kept layers into `target`'s (built and sharded for the new
        generation) and give their optimizer state, re-laid on the new lanes' mesh."""
        for i in kept:
            old_layer, new_layer = self.layer_model.layers[i], target.layers[i]
            assert old_layer is not None and new_layer is not None
            for (_, old), (name, new) in zip(old_layer.named_parameters(), new_layer.named_parameters()):
                with torch.no_grad():
                    local(new).copy_(_shard_of(new_layer, name, old))
                if old in old_state:
                    yield new, {k: v.clone() if k == "step" else wrap_like(new, _shard_of(new_layer, name, v).clone())
                                for k, v in old_state[old].items()}

    def _hand_over(self, plan: Plan, rank: int, transfers: list[Transfer], *, exchange_layers: bool) -> int:
        """A donor's part of the entry: send the layers (with their optimizer state) the plan's
        stages need from it, then leave the generation. Returns the bytes sent."""
        moved = 0
        if exchange_layers:
            _, moved = exchange(transfers, rank=rank, source=self.layer_model, optimizer=self.optimizer,
                                target=self.layer_model)
        _release_donors()
        release_groups(abort=False)
        # drop the previous generation's pipeline and groups now, as a stage's next generation
        # does: process groups left for the interpreter's exit to destroy abort it
        self.stage_module = None
        self._drop_groups()
        self.plan, self.generation, self.owned, self.optimizer = plan, plan.generation, [], None
        self.layer_model = build_layer_model(self.cfg.model, seed=self.cfg.training.seed, owned=[],
                                             device=str(self.device))
        gc.collect()
        return moved

    def _kept_layers(self, kept: list[int]) -> tuple[dict[int, nn.Module], list[tuple[nn.Parameter, nn.Parameter]]]:
        """The kept layers for the next generation and (old, new) pairs of their parameters: the
        layers themselves, or copies after an abandoned step (whose thread may still run)."""
        layers: dict[int, nn.Module] = {}
        pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        for i in kept:
            old = self.layer_model.layers[i]
            assert old is not None
            new = copy.deepcopy(old) if self._detach_kept else old
            layers[i] = new
            pairs += list(zip(old.parameters(), new.parameters()))
        return layers, pairs
