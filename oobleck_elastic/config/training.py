"""The `training` section of the job config, with its `optimizer` and `lr_schedule` sections.

Batch sizes, steps, the optimizer and its learning-rate schedule, precision, device, seed and
compilation, and the knobs of benchmarks (paced devices) and MFU (peak TFLOP/s).
`TrainingConfig.validate()` checks its own rules and those of the two sections it holds. The
fields: docs/config.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from .schema import Section, at_least

# The choices of this section's choice fields (schema.py: omegaconf refuses any other value).
OptimizerName = Literal["adamw", "sgd"]
LRDecay = Literal["constant", "linear", "cosine"]
Precision = Literal["fp32", "bf16"]
DeviceKind = Literal["auto", "cpu", "cuda"]
ActivationCheckpoint = Literal["none", "full", "auto"]


@dataclass
class OptimizerConfig(Section):
    name: OptimizerName = "adamw"
    """Optimizer: `adamw` or `sgd`."""
    lr: float = 3e-4
    """Peak learning rate."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    grad_clip: float = 1.0
    """Global gradient-norm clip across all stages and replicas; 0 disables."""

    def validate(self) -> list[str]:
        p = "training.optimizer"
        out = [] if self.lr > 0 else [f"'{p}.lr' must be > 0 (got {self.lr})"]
        out += at_least(p, self, ("eps", "weight_decay", "grad_clip"), 0)
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            out.append(f"'{p}.betas' must be two numbers in [0, 1) (got {list(self.betas)})")
        return out


@dataclass
class LRScheduleConfig(Section):
    warmup_steps: int = 0
    """Linear warm-up steps."""
    decay: LRDecay = "cosine"
    """After warm-up: `constant`, `linear` or `cosine` down to min_lr_ratio x lr at the last step."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""

    def validate(self) -> list[str]:
        return at_least("training.lr_schedule", self, ("warmup_steps",), 0)


@dataclass
class TrainingConfig(Section):
    global_batch_size: int = 16
    """Samples per optimizer step, summed over all pipelines."""
    microbatch_size: Union[int, str] = 2
    """Samples per microbatch; global_batch_size must be a multiple of it. `auto` = the planner
    picks it for the job, once: the divisor of global_batch_size (up to global_batch_size /
    (f+1)) whose plan has the best estimated samples/s with every stage fitting in memory
    (planning/profile/microbatch.py); the plan carries it to every worker."""
    steps: int = 20
    """Optimizer steps to run."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer settings."""
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    """Learning-rate schedule."""
    precision: Precision = "fp32"
    """`fp32` or `bf16` (autocast, fp32 master weights)."""
    activation_checkpoint: ActivationCheckpoint = "none"
    """`none`: every layer keeps its activations for the backward; `full`: a layer keeps only its
    input and runs its forward once more in the backward, under every schedule: less memory, about
    one more forward of compute; `auto`: the planner chooses per stage, with the schedule, the
    least recomputation that fits the device's memory (none if the stage fits without, else full),
    and the plan tells each worker its stage's mode (docs/training.md, "Activation checkpointing")."""
    device: DeviceKind = "auto"
    """`auto` (a worker trains on `cuda:<LOCAL_RANK>` when CUDA is available, else on the CPU),
    `cpu` or `cuda`. Data (pipeline send/receive, gradient sync, layer transfers) then runs over
    NCCL on CUDA and gloo on the CPU; control collectives always run on CPU tensors over gloo."""
    seed: int = 1234
    """Seeds layer initialisation (per layer index) and data order (per step)."""
    compile: Optional[bool] = None
    """Compile every layer with torch.compile (one set of graphs per kind of layer, shared by
    identical blocks, compiled before the worker joins so that reconfiguration never compiles; the
    backward is compiled as an input-gradient and a weight-gradient graph, so every schedule runs,
    zero-bubble included; see engine/stage/compiled.py). None = on for CUDA, off for the CPU."""
    paced_devices: float = 0.0
    """For benchmarks, tests and the demo (configs/gpt2-demo.yaml), never for real training: 0 (the
    default) = off. When > 0, every
    forward and backward (input- and weight-gradient pass when the backward is split) of one
    microbatch on a stage is padded by a sleep to the plan's time for that stage's layers (from
    the profile) times this factor, so that workers sharing a machine's cores behave like devices
    of their own (engine/stage/paced.py; bench/schedules.py). Pick it so that the real arithmetic
    is a small part of the padded time; on the CPU each worker then also uses one intra-op thread."""
    peak_tflops: Optional[float] = None
    """Dense peak TFLOP/s of one device at the training precision, for MFU. None = from the table
    of known GPUs (engine/telemetry/mfu.py: H100, H200, A100, ...); CPUs and unlisted GPUs then report MFU
    as unknown."""

    def validate(self) -> list[str]:
        problems = self.optimizer.validate() + self.lr_schedule.validate()
        problems += at_least("training", self, ("global_batch_size",), 1)
        problems += at_least("training", self, ("steps",), 0)
        mbs = self.microbatch_size
        if mbs != "auto" and (isinstance(mbs, (str, bool)) or mbs < 1):
            problems.append(f"'training.microbatch_size' is {mbs!r}: give a number >= 1 or auto")
        elif isinstance(mbs, int) and self.global_batch_size % mbs:
            problems.append(
                f"'training.global_batch_size' ({self.global_batch_size}) must be a multiple of "
                f"'training.microbatch_size' ({mbs}): change one of them, e.g. "
                f"training.global_batch_size={(self.global_batch_size // mbs + 1) * mbs}"
            )
        if self.paced_devices < 0:
            problems.append(f"'training.paced_devices' must be >= 0 (got {self.paced_devices}); 0 turns pacing off")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            problems.append(
                f"'training.peak_tflops' must be > 0 (got {self.peak_tflops}); leave it unset for the table"
            )
        return problems
