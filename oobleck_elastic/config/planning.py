"""The `planning` section of the job config: the devices, links, schedule and profile the planner uses.

Device and host memory, devices per node and tensor parallelism, the links' bandwidth and
latency, the pipeline schedule and its chunks per device, the cluster's size, and how the
profile is found or measured, and the device classes of a mixed fleet (`DeviceClass`).
`schedule_chunks_problem` is the one rule between the schedule and its chunks, shared with the
planner's schedule choice (`planning.schedules.choice`). The fields: docs/config.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Union, get_args

from .schema import Section, at_least

# The choices of this section's choice fields (schema.py: omegaconf refuses any other value).
Schedule = Literal["1f1b", "gpipe", "interleaved-1f1b", "zero-bubble", "zbv", "auto"]
MAX_CHUNKS = 8
"""The most chunks per device `planning.chunks_per_device` accepts (and `auto` tries)."""


def schedule_chunks_problem(schedule: str, chunks: Union[int, str]) -> Optional[str]:
    """Why `planning.schedule` and `planning.chunks_per_device` cannot go together, or None."""
    if chunks == "auto":
        return None
    if isinstance(chunks, bool) or not isinstance(chunks, int) or not 1 <= chunks <= MAX_CHUNKS:
        return f"'planning.chunks_per_device' is {chunks!r}: use auto or 1..{MAX_CHUNKS}"
    if schedule in ("1f1b", "gpipe") and chunks != 1:
        return (
            f"planning.schedule={schedule} runs one stage per device but planning.chunks_per_device={chunks}: "
            "use interleaved-1f1b or zero-bubble for more chunks, or chunks_per_device=auto"
        )
    if schedule == "zbv" and chunks != 2:
        return (
            f"planning.schedule=zbv runs exactly 2 chunks per device but planning.chunks_per_device={chunks}: "
            "use 2 or auto"
        )
    return None


@dataclass
class DeviceClass(Section):
    """One class of nodes in a mixed fleet (`planning.classes.<name>`): its devices and their speed.
    A key left unset takes the `planning` value of the same name."""

    peak_tflops: Optional[float] = None
    """Dense peak TFLOP/s of one device of this class at the job's precision (e.g. 989 for an H100
    in bf16). With the profiled class's, it gives the speed ratio the profile's times are scaled
    by: a class twice the profiled class's peak runs each layer in half its time."""
    speed: Optional[float] = None
    """This class's speed relative to the devices the profile was measured on, measured (e.g. 1.8:
    each layer takes 1/1.8 of the profile's time). Takes precedence over the peak_tflops ratio."""
    device_memory_gb: Optional[float] = None
    """Memory of one device of this class (GiB) available to one stage; None = planning.device_memory_gb."""
    gpus_per_node: Optional[int] = None
    """Devices per node of this class; None = planning.gpus_per_node."""
    profile_path: Optional[str] = None
    """A profile measured on a device of this class (its own times, not scaled); relative to the
    config file's folder. `{tp}` picks one file per tensor-parallel degree, as planning.profile_path."""

    def problems(self, name: str) -> list[str]:
        """This class's broken rules, each naming `planning.classes.<name>.<key>`."""
        out = []
        for key in ("peak_tflops", "speed", "device_memory_gb"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                out.append(f"'planning.classes.{name}.{key}' must be > 0 (got {value})")
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            out.append(f"'planning.classes.{name}.gpus_per_node' must be >= 1 (got {self.gpus_per_node})")
        return out


@dataclass
class PlanningConfig(Section):
    device_memory_gb: float | None = None
    """Memory of one device (GiB) available to one stage; a HARD limit for the planner. None
    (the default) = the total memory of the device the profile was measured on (recorded by the
    worker that profiled it on CUDA); set it for CPU jobs, for profile files that record no
    device memory, or to plan below the device's real memory."""
    memory_margin: float = 0.1
    """Fraction of device_memory_gb kept free for allocator slack and buffers."""
    host_memory_gb: Optional[float] = None
    """Host memory (GiB) of each node that shadow copies (fault_tolerance.shadow_copies) may
    use; a hard limit for their placement. None = measured: the memory available now on the
    machine that plans (MemAvailable)."""
    gpus_per_node: int = 1
    """Devices (workers) per node; a template on n nodes has n x gpus_per_node / tensor_parallel stages."""
    tensor_parallel: Union[int, str] = 1
    """Devices one stage runs on, all on one node: its layers are sharded over them (tensor
    parallelism). A divisor of gpus_per_node; 1 = one device per stage; `auto` = the degree with
    the best estimated throughput, chosen once for the job (for planning.max_nodes nodes when
    set, else the first plan's) from a profile per degree (profile_path with `{tp}` in it)."""
    intra_node_bandwidth_gb_s: float = 150.0
    """Bandwidth between two devices of one node, GB/s per device (NVLink class); costs pipeline
    sends between stages on one node."""
    inter_node_bandwidth_gb_s: float = 12.5
    """Bandwidth between devices of different nodes, GB/s per device (a 100 Gb/s NIC each); costs
    pipeline sends across nodes and the cross-replica gradient all-reduce."""
    link_latency_us: float = 10.0
    """Latency of one message between devices, microseconds."""
    count_communication: bool = True
    """Count communication in the planner's step-time estimate (False: compute only, as before)."""
    schedule: Schedule = "1f1b"
    """Pipeline schedule: `1f1b` (stage i of S keeps up to S-i microbatches), `gpipe` (every
    stage keeps all microbatches), `interleaved-1f1b` (several non-contiguous stages per device,
    chunks_per_device), `zero-bubble` (ZB-H1: the backward split into input and weight
    gradients, the weight gradients filling the bubble; with chunks, its interleaved form), `zbv`
    (two stages per device in a V), or `auto` (per pipeline, the fastest that fits in memory).
    Planned by simulating each schedule's actions; the engine runs every one (interleaved-1f1b
    with 2..8 chunks; zero-bubble with 1..8, any microbatch count with one chunk; zbv with 2),
    compiled layers included, so a job's `auto` plans as `oobleck plan` does."""
    chunks_per_device: Union[int, str] = "auto"
    """Stages (chunks) per device for interleaved-1f1b and zero-bubble: 1..8, or `auto` (the
    fastest that fits). 1f1b and gpipe run 1, zbv 2."""
    max_nodes: Optional[int] = None
    """Largest cluster the job runs on (torchrun --nnodes MAX); the config is refused when
    that many nodes cannot hold f+1 pipelines. None = no check."""
    replan_tolerance: float = 0.01
    """On a re-plan, the step time a plan that moves fewer layers may cost: the plan that keeps
    every pipeline the change did not touch (only the touched pipelines' nodes, the spares and
    the new nodes are formed again) is taken over the fastest plan when its estimated step is at
    most this fraction slower and its busiest receiver gets no more bytes. 0 = always the fastest
    plan (which may re-form every pipeline and move layers across the whole cluster)."""
    classes: dict[str, DeviceClass] = field(default_factory=dict)
    """Device classes of a mixed fleet by name (`oobleck plan --classes h100=512,a100=384`): each
    class's devices, memory and speed (`planning.classes.<name>.*`). Empty = every node is alike."""
    profiled_class: Optional[str] = None
    """The class whose devices the profile (planning.profile_path, or the one measured) was measured
    on: the other classes' times are its times scaled by their speed (`speed`, else the ratio of
    `peak_tflops`). Needed when classes are given and some class has no profile_path of its own."""
    max_template_nodes: Optional[int] = None
    """Largest template size in nodes; None = as many as there are layers to split."""
    profile_path: Optional[str] = None
    """Use this profile JSON instead of measuring (required for planning-only models). A relative
    path: see Paths."""
    reprofile: bool = False
    """Measure the profile again even when `data.cache_dir/profiles/` holds one for this model,
    microbatch shape and device (e.g. one measured while the machine was busy), and replace it
    (`oobleck plan --reprofile` does the same). Not used with profile_path."""
    profile_warmup: int = 1
    """Profiler warm-up runs per layer."""
    profile_repeats: int = 5
    """Profiler timed runs per layer (the median is kept)."""
    profile_identical_blocks_once: bool = True
    """Measure each kind of layer once: blocks with the same class, attributes and parameter
    shapes (every decoder block of GPT-2 or Llama) reuse the first one's numbers. False = build
    and time every layer (part of the profile's cache key)."""

    def validate(self) -> list[str]:
        problems = at_least("planning", self, ("gpus_per_node", "profile_repeats"), 1)
        problems += at_least("planning", self, ("profile_warmup",), 0)
        if self.device_memory_gb is not None and self.device_memory_gb <= 0:
            problems.append(f"'planning.device_memory_gb' must be > 0 (got {self.device_memory_gb})")
        if self.host_memory_gb is not None and self.host_memory_gb <= 0:
            problems.append(
                f"'planning.host_memory_gb' must be > 0 (got {self.host_memory_gb}); leave it unset to measure it"
            )
        if self.replan_tolerance < 0:
            problems.append(f"'planning.replan_tolerance' must be >= 0 (got {self.replan_tolerance})")
        if not 0 <= self.memory_margin < 1:
            problems.append(f"'planning.memory_margin' must be in [0, 1) (got {self.memory_margin})")
        tp = self.tensor_parallel
        if tp != "auto" and (isinstance(tp, str) or tp < 1 or (self.gpus_per_node >= 1 and self.gpus_per_node % tp)):
            problems.append(
                f"'planning.tensor_parallel' is {tp!r}: give a divisor of planning.gpus_per_node "
                f"({self.gpus_per_node}) or auto"
            )
        if tp != 1 and not self.profile_path:
            problems.append(
                f"'planning.tensor_parallel' is {tp} but 'planning.profile_path' is not set: workers measure "
                "profiles on one device; measure one at each degree with `torchrun --nproc-per-node T -m "
                "oobleck_elastic.planning.profile.tp --config CFG --out profile-tp{tp}.json` and set "
                "planning.profile_path=profile-tp{tp}.json"
            )
        if self.intra_node_bandwidth_gb_s <= 0 or self.inter_node_bandwidth_gb_s <= 0 or self.link_latency_us < 0:
            problems.append(
                "'planning.intra_node_bandwidth_gb_s' and 'planning.inter_node_bandwidth_gb_s' must be > 0 "
                "and 'planning.link_latency_us' >= 0 (got "
                f"{self.intra_node_bandwidth_gb_s}, {self.inter_node_bandwidth_gb_s}, {self.link_latency_us})"
            )
        if self.max_nodes is not None and self.max_nodes < 1:
            problems.append(f"'planning.max_nodes' must be >= 1 (got {self.max_nodes})")
        for name, cls in self.classes.items():
            problems += cls.problems(name)
        if self.profiled_class is not None and self.profiled_class not in self.classes:
            known = ", ".join(sorted(self.classes)) or "none"
            problems.append(
                f"'planning.profiled_class' is {self.profiled_class!r} but planning.classes defines {known}: "
                "name one of them"
            )
        if self.schedule in get_args(Schedule):  # a name outside them is its own clause already
            why = schedule_chunks_problem(self.schedule, self.chunks_per_device)
            if why:
                problems.append(why)
        return problems
