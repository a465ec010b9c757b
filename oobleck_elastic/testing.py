"""Synthetic inputs for tests, benchmarks and drills: shared here so neither imports the other.

`RandomTokens` (deterministic windows of random tokens, a dataset with no file behind it),
`layout_plan` (a plan from layer ranges per stage, without the planner) and `tiny_profile` (a
profile whose 6 layers of 0.4 GiB each force multi-stage pipelines on 1.25 GiB devices, with the
`TINY_PROFILE_OVERRIDES` that plan them so).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from .planning import LayerProfile, ModelProfile, PipelineSpec, Plan, StagePlacement

__all__ = ["RandomTokens", "layout_plan", "uniform_profile", "tiny_profile", "TINY_PROFILE_OVERRIDES"]


class RandomTokens:
    """Deterministic synthetic windows (input, next-token labels) of random tokens."""

    def __init__(self, n: int = 64, seq_len: int = 16, vocab: int = 256) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, vocab, (n, seq_len + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        return self.data[i, :-1], self.data[i, 1:]


def layout_plan(
    layout: list[list[tuple[int, int]]],
    microbatches: list[int],
    *,
    generation: int,
    num_layers: int = 6,
    microbatch_size: int = 2,
    schedule: str = "1f1b",
    chunks: int = 1,
) -> Plan:
    """A plan from layer ranges per stage, one pipeline per entry, one device per node `n<rank>`,
    every pipeline running `schedule`. With `chunks` > 1 a pipeline's ranges are its virtual
    stages in pipeline order, placed as the schedule places them (`planning.schedules.schedules`
    `stage_placement`): loop placement, device d of D holding ranges d, D + d, ..., or zbv's V,
    device d holding ranges d and 2 D - 1 - d."""
    from .planning.schedules.schedules import stage_placement

    pipelines, rank = [], 0
    for index, (ranges, mb) in enumerate(zip(layout, microbatches, strict=True)):
        devices = len(ranges) // chunks
        placed = stage_placement(schedule, devices, chunks)
        stages = []
        for s in range(devices):
            held = tuple(r for r, d in zip(ranges, placed) if d == s) if chunks > 1 else ()
            u, v = ranges[s]
            stages.append(
                StagePlacement(index=s, start=u, end=v, node=f"n{rank}", local_rank=0, rank=rank, chunks=held)
            )
            rank += 1
        pipelines.append(
            PipelineSpec(
                index=index,
                template_nodes=devices,
                nodes=tuple(st.node for st in stages),
                microbatches=mb,
                stages=tuple(stages),
                est_time_s=1.0,
                schedule=schedule,
                num_chunks=chunks,
            )
        )
    plan = Plan(
        generation=generation,
        nodes=tuple(f"n{r}" for r in range(rank)),
        spares=(),
        gpus_per_node=1,
        num_layers=num_layers,
        microbatch_size=microbatch_size,
        pipelines=tuple(pipelines),
        est_step_time_s=1.0,
        f=1,
    )
    plan.check()
    return plan


def node_plan(
    generation: int,
    pipelines: list[list[tuple[str, int, int]]],
    microbatches: Optional[list[int]] = None,
    *,
    num_layers: int = 6,
) -> Plan:
    """A plan from pipelines given as [(node, first layer, end layer), ...] per stage, one device
    per node, ranks in order, 4 microbatches per pipeline unless `microbatches` says otherwise."""
    specs, rank = [], 0
    for index, stages in enumerate(pipelines):
        placed = []
        for s, (node, start, end) in enumerate(stages):
            placed.append(StagePlacement(index=s, start=start, end=end, node=node, local_rank=0, rank=rank))
            rank += 1
        specs.append(
            PipelineSpec(
                index=index,
                template_nodes=len(stages),
                nodes=tuple(n for n, _, _ in stages),
                microbatches=microbatches[index] if microbatches is not None else 4,
                stages=tuple(placed),
                est_time_s=1.0,
            )
        )
    return Plan(
        generation=generation,
        nodes=tuple(n for stages in pipelines for n, _, _ in stages),
        spares=(),
        gpus_per_node=1,
        num_layers=num_layers,
        microbatch_size=2,
        pipelines=tuple(specs),
        est_step_time_s=1.0,
        f=1,
    )


def uniform_profile(
    layers: int = 6,
    *,
    gib_per_layer: float = 0.4,
    name: str = "l",
    tensor_parallel: int = 1,
    key: Optional[dict[str, Any]] = None,
    device_memory_bytes: Optional[int] = None,
) -> ModelProfile:
    """`layers` identical layers of `gib_per_layer` GiB each (params + grads + AdamW's two states,
    a quarter each), 10 ms forward and 20 ms backward, no activations."""
    b = int(gib_per_layer / 4 * 1024**3)
    return ModelProfile(
        layers=[
            LayerProfile(
                name=f"{name}{i}",
                forward_s=0.01,
                backward_s=0.02,
                param_bytes=b,
                grad_bytes=b,
                optimizer_bytes=2 * b,
                activation_bytes=0,
            )
            for i in range(layers)
        ],
        key=dict(key or {}),
        device_memory_bytes=device_memory_bytes,
        tensor_parallel=tensor_parallel,
    )


def tiny_profile(path: Path, tensor_parallel: int = 1) -> Path:
    """6 layers of 0.4 GiB (params+grads+AdamW) planned on 1.25 GiB devices: n0 = 2 nodes, so
    gpt2-tiny runs as 2-stage pipelines (3 nodes: one 3-stage pipeline; 4 nodes: 2 x 2 stages);
    with `tensor_parallel` = gpus_per_node, one stage per node."""
    uniform_profile(tensor_parallel=tensor_parallel).save(path)
    return path


TINY_PROFILE_OVERRIDES = ["planning.device_memory_gb=1.25", "planning.memory_margin=0"]
