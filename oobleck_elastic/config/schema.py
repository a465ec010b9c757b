"""The job config's schema: one dataclass per section, each field with a docstring below it, and
beside the fields the rules their types cannot express.

Types do most of the checking: omegaconf refuses an unknown key, a value of the wrong type and,
for the choice fields (typed `Literal[...]`), any value not listed. The rest (ranges and
combinations: f >= 0, a global batch that is a multiple of the microbatch, a source that needs
paths) is each section's `validate()`, which returns one clause per broken rule, naming the key
by its dotted path and what to change; `JobConfig.validate()` gathers the sections' clauses and
adds the rules that span sections. The field docstrings are the configuration reference
(`oobleck config reference`, docs/config.md).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import get_args, Literal, Optional, Sequence, Union


class ConfigError(ValueError):
    """A configuration problem, with a message that names the key and what to change."""


# The choices of the choice fields. omegaconf (>= 2.4) refuses any other value when it merges a
# YAML file or an override; load_config words that as "'key' is 'x'; choose one of a, b".
ModelFamily = Literal["gpt2", "llama", "mistral", "qwen2", "custom"]
AttnImplementation = Literal["sdpa", "eager"]
DataSource = Literal["stdlib", "files", "jsonl", "parquet", "hf_disk", "tokens"]
TokenizerKind = Literal["bytes", "bpe", "hf"]
TokenDtype = Literal["uint16", "uint32"]
OptimizerName = Literal["adamw", "sgd"]
LRDecay = Literal["constant", "linear", "cosine"]
Precision = Literal["fp32", "bf16"]
DeviceKind = Literal["auto", "cpu", "cuda"]
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


LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


PATH_KEYS = (
    "model.pretrained_path",
    "data.paths",
    "data.tokenizer_path",
    "data.cache_dir",
    "planning.profile_path",
    "checkpoint.dir",
    "logging.tensorboard_dir",
    "logging.events_dir",
)
"""The keys that hold file system paths. A relative path written in a config FILE is relative to
that file's folder (`configs/x.yaml` saying `data.paths: [corpus.jsonl]` reads
`configs/corpus.jsonl`, from whatever directory the job starts in); a relative path given as a
command-line override, and the defaults (`checkpoints`, `runs`, `.oobleck-cache`), are relative to
the working directory. `load_config` makes the file's paths absolute; `~` is expanded."""


class Section:
    """A section of the job config. `validate()` returns one clause per broken rule of the
    section (ranges, combinations: what its field types cannot express), naming each key by its
    full dotted path; an empty list means the section is fine. A section that holds sections
    checks them too."""

    def validate(self) -> list[str]:
        return []


def _at_least(prefix: str, section: object, names: Sequence[str], low: int) -> list[str]:
    """A clause for each field `names` of `section` (keys `prefix.name`) below `low`."""
    return [
        f"'{prefix}.{name}' must be >= {low} (got {getattr(section, name)})"
        for name in names
        if getattr(section, name) < low
    ]


@dataclass
class ModelConfig(Section):
    family: ModelFamily = "gpt2"
    """Model family: `gpt2`, `llama`, `mistral` or `qwen2` (Hugging Face classes, built from this
    config with random weights), or `custom` (see `custom_factory`)."""
    vocab_size: int = 256
    """Vocabulary size (256 = raw bytes, the fastest tokenizer)."""
    pad_vocab_to: int = 64
    """The embedding and LM head get vocab_size rounded up to a multiple of this many rows (GPT-2's
    50257 -> 50304: matrix shapes the GPU kernels like). Padded rows stay zero, are left out of the
    loss, and are dropped from checkpoints and exports (models/vocab.py); 1 = no padding."""
    hidden_size: int = 64
    """Width of the residual stream."""
    num_layers: int = 4
    """Number of decoder blocks. The flat layer list has num_layers + 2 layers
    (embedding, blocks, final norm + LM head)."""
    num_heads: int = 4
    """Attention heads."""
    num_kv_heads: Optional[int] = None
    """Key/value heads for grouped-query attention (Llama family); None = num_heads."""
    intermediate_size: Optional[int] = None
    """MLP width; None = 4 x hidden_size."""
    max_seq_len: int = 64
    """Longest sequence the position embedding supports."""
    tie_embeddings: bool = True
    """Share the token embedding with the LM head (GPT-2 always does)."""
    dropout: float = 0.0
    """Dropout probability (0 keeps runs bit-comparable with the single-process reference)."""
    attn_implementation: AttnImplementation = "sdpa"
    """`sdpa` or `eager`; both are causal."""
    pretrained_path: Optional[str] = None
    """Local directory with Hugging Face weights (config.json + safetensors); no hub downloads.
    A relative path: see Paths."""
    custom_factory: Optional[str] = None
    """For family=custom: `module:function` returning a list[nn.Module] of layers."""

    def validate(self) -> list[str]:
        problems = _at_least(
            "model", self, ("vocab_size", "pad_vocab_to", "hidden_size", "num_layers", "num_heads", "max_seq_len"), 1
        )
        if self.hidden_size >= 1 and self.num_heads >= 1 and self.hidden_size % self.num_heads:
            problems.append(
                f"'model.hidden_size' ({self.hidden_size}) must be a multiple of 'model.num_heads' ({self.num_heads})"
            )
        if self.num_kv_heads is not None and (self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads):
            problems.append(
                f"'model.num_heads' ({self.num_heads}) must be a multiple of 'model.num_kv_heads' ({self.num_kv_heads})"
            )
        if self.family == "custom" and not self.custom_factory:
            problems.append(
                "'model.family' is custom but 'model.custom_factory' is not set "
                "(give module:function returning a list[nn.Module])"
            )
        return problems


@dataclass
class DataConfig(Section):
    source: DataSource = "stdlib"
    """`stdlib` (the Python standard library's source files, present on every machine), `files`
    (the text files in `paths`), `jsonl` / `parquet` (JSON-lines / Parquet files, or directories
    of *.jsonl, *.json / *.parquet, in `paths`; one document per row), `hf_disk` (the
    `datasets.Dataset.save_to_disk` directory `paths[0]`) or `tokens` (pre-tokenized flat .bin or
    1-D .npy files in `paths`, memory-mapped as they are, in order; no tokenizer, no cache)."""
    paths: list[str] = field(default_factory=list)
    """Files or directories of the source (all sources but stdlib). Relative paths: see Paths."""
    tokenizer: TokenizerKind = "bytes"
    """`bytes` (vocab 256), `bpe` (byte-level BPE trained on the corpus and cached) or `hf` (the
    pretrained tokenizer in `tokenizer_path`). Not used by source=tokens."""
    tokenizer_path: Optional[str] = None
    """For tokenizer=hf: a local directory saved with `save_pretrained` (`transformers`), or a
    `tokenizers` JSON file (`Tokenizer.save("tok.json")`, holding GPT-2's end-of-text special token);
    its vocabulary must fit model.vocab_size. Nothing is downloaded. A relative path: see Paths."""
    text_field: str = "text"
    """The column holding each document's text (source=jsonl, parquet, hf_disk)."""
    token_dtype: TokenDtype = "uint16"
    """dtype of the .bin files of source=tokens: `uint16` (nanoGPT; ids < 65536) or `uint32`.
    .npy files carry their own dtype."""
    num_proc: int = 1
    """Processes that tokenise a text dataset (1 = in the worker itself, which a fast tokenizer
    already spreads over threads); raise it for large corpora. Tokenising happens once per host."""
    seq_len: int = 64
    """Tokens per sample (the microbatch shape is microbatch_size x seq_len)."""
    cache_dir: str = ".oobleck-cache"
    """Where tokenizers, token files, Arrow copies of JSONL/Parquet datasets and profiles are cached.
    A relative path: see Paths."""

    def validate(self) -> list[str]:
        problems = _at_least("data", self, ("seq_len", "num_proc"), 1)
        if self.source in ("files", "jsonl", "parquet", "hf_disk", "tokens") and not self.paths:
            problems.append(f"'data.source' is {self.source} but 'data.paths' is empty")
        if self.source == "hf_disk" and len(self.paths) > 1:
            problems.append(
                f"'data.source' is hf_disk but 'data.paths' has {len(self.paths)} entries: give the one "
                "directory written by Dataset.save_to_disk"
            )
        if self.tokenizer == "hf" and self.source != "tokens" and not self.tokenizer_path:
            problems.append(
                "'data.tokenizer' is hf but 'data.tokenizer_path' is not set: give the directory of a "
                "tokenizer saved with save_pretrained"
            )
        if self.tokenizer_path and self.tokenizer != "hf":
            problems.append(
                f"'data.tokenizer_path' is set but 'data.tokenizer' is {self.tokenizer}: "
                "set data.tokenizer=hf to use it"
            )
        return problems


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
        out += _at_least(p, self, ("eps", "weight_decay", "grad_clip"), 0)
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
        return _at_least("training.lr_schedule", self, ("warmup_steps",), 0)


@dataclass
class TrainingConfig(Section):
    global_batch_size: int = 16
    """Samples per optimizer step, summed over all pipelines."""
    microbatch_size: Union[int, str] = 2
    """Samples per microbatch; global_batch_size must be a multiple of it. `auto` = the planner
    picks it for the job, once: the divisor of global_batch_size (up to global_batch_size /
    (f+1)) whose plan has the best estimated samples/s with every stage fitting in memory
    (planning/microbatch.py); the plan carries it to every worker."""
    steps: int = 20
    """Optimizer steps to run."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer settings."""
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    """Learning-rate schedule."""
    precision: Precision = "fp32"
    """`fp32` or `bf16` (autocast, fp32 master weights)."""
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
    zero-bubble included; see engine/step/compiled.py). None = on for CUDA, off for the CPU."""
    paced_devices: float = 0.0
    """For benchmarks and tests, never for training: 0 (the default) = off. When > 0, every
    forward and backward (input- and weight-gradient pass when the backward is split) of one
    microbatch on a stage is padded by a sleep to the plan's time for that stage's layers (from
    the profile) times this factor, so that workers sharing a machine's cores behave like devices
    of their own (engine/step/paced.py; bench/schedules.py). Pick it so that the real arithmetic
    is a small part of the padded time; on the CPU each worker then also uses one intra-op thread."""
    peak_tflops: Optional[float] = None
    """Dense peak TFLOP/s of one device at the training precision, for MFU. None = from the table
    of known GPUs (engine/telemetry/mfu.py: H100, H200, A100, ...); CPUs and unlisted GPUs then report MFU
    as unknown."""

    def validate(self) -> list[str]:
        problems = self.optimizer.validate() + self.lr_schedule.validate()
        problems += _at_least("training", self, ("global_batch_size",), 1)
        problems += _at_least("training", self, ("steps",), 0)
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


@dataclass
class FaultToleranceConfig(Section):
    f: int = 1
    """Simultaneous node failures to survive without a checkpoint (>= f+1 pipelines)."""
    shadow_copies: int = 0
    """Copies of every layer's weights and optimizer state kept in the host memory of that many
    nodes that do not hold the layer on their devices (0 = none): with f+1 device copies, any
    f + shadow_copies simultaneous node losses leave a copy of every layer. The planner places
    them within planning.host_memory_gb (planning/shadows.py) on nodes running stages, and
    `oobleck plan` shows them. The holders send each step's summed gradients to the shadows, which
    apply the same AdamW update in host memory before the step commits, so a layer whose device
    copies are all lost comes back from a shadow with no step lost (engine/generation/shadows.py).
    Not with tensor parallelism (planning.tensor_parallel must be 1)."""
    lease_ttl_s: float = 5.0
    """etcd lease TTL of a node's membership record."""
    settle_s: float = 0.5
    """Window in which simultaneous membership changes are batched into one re-plan."""
    comm_timeout_s: Optional[float] = None
    """Timeout of a step's communication (pipeline sends and receives, gradient sums, the commit)
    and of every collective once connected. A step may take this long, the first one of a
    generation included (allocator warm-up, kernel autotuning, compilation, a large stage): a
    slow peer is not a failure. Dead and hung peers are found by the control plane (liveness
    sockets, leases, the roll call, the hang watch), which abandons the step without waiting for
    this timeout; an abandoned gloo call keeps its thread, and the previous copy of its layers,
    until it. None (auto): 300 s until the worker has measured a step, then max(120 s, 3 x the
    hang bound) at each generation's entry (config/timing.py)."""
    join_timeout_s: float = 3.0
    """Timeout of connecting a generation's collective groups. A peer that dies during a
    reconfiguration, after publishing its address, holds the others in gloo's connection set-up
    for about 5x this long (gloo retries) before they move on; once connected, groups switch to
    comm_timeout_s. It never applies to a step: pipeline groups, whose gloo receives keep the
    timeout they connected with, connect under comm_timeout_s. Raise it when thousands of ranks
    connect slowly."""
    stall_report_s: Optional[float] = None
    """A worker waiting this long for its peers while joining a generation checks in at the
    leader's roll call, which pings the nodes not heard from and re-plans without the dead ones
    (a node killed during a reconfiguration); 0 disables it. None (auto): max(1 s, the worker's
    typical step) (config/timing.py)."""
    rendezvous_timeout_s: float = 600.0
    """How long the first rendezvous waits for the minimum number of nodes."""
    max_repeated_errors: int = 3
    """A worker error that is not a communication failure (a bug in the model, out of memory, a
    corrupt checkpoint) ends that worker with its traceback; when the same error ends a worker
    at the same step this many times in a row, the job is closed as failed with that error
    instead of being re-planned again."""
    preempt_signals: list[str] = field(default_factory=lambda: ["SIGTERM"])
    """Signals to a node's agent that are a preemption notice (Slurm, Kubernetes and spot reclaims
    send SIGTERM; add e.g. SIGUSR1 for Slurm's --signal=USR1@90): the node is drained, hands its
    layers over and exits 0 instead of failing (rendezvous/preempt.py)."""
    preempt_grace_s: float = 60.0
    """Seconds a node has, after its preemption notice, to hand its layers over and leave; a node
    still there then is stopped and handled as a failure."""
    hang_floor_s: Optional[float] = None
    """A worker whose step thread makes no progress (no compute chunk, no communication call
    entered or left, and not waiting for a peer in one) for longer than max(hang_floor_s,
    hang_factor x its typical step) while its node is alive is hung: its agent records its
    stacks, stops it and restarts it, and the job re-plans (rendezvous/hang.py). The floor covers
    a first step; 0 = off. None (auto): 120 s until the worker has measured a step, then 30 s
    (config/timing.py)."""
    hang_factor: float = 10.0
    """See hang_floor_s; the typical step is the median wall time of the worker's last steps."""
    max_skipped_steps: int = 3
    """A step whose loss or gradient norm is not finite (or whose loss spikes, see
    loss_spike_factor) is never applied: it is replayed once, then its batch is skipped. This many
    skipped steps in a row stop the job as failed, naming them (engine/resilience/guard.py)."""
    loss_spike_factor: float = 0.0
    """Treat a loss above this factor times the largest loss of any applied step like a non-finite
    one (replayed, then skipped); 0 = off. Megatron-LM uses 10."""
    fingerprint_interval_steps: int = 0
    """Every this many steps, the holders of each layer compare fingerprints of their copies
    (weights and optimizer state); a copy that differs from a majority is replaced in place, and
    copies with no majority stop the job naming the layer and its nodes (engine/resilience/fingerprint.py).
    0 = off."""
    straggler_factor: float = 1.5
    """A node whose workers compute this many times slower per microbatch than the generation's
    typical worker (against the plan's estimate of their stages), over straggler_steps steps, is
    named a straggler (event, TensorBoard, `oobleck status`; engine/resilience/straggler.py); 0 = off."""
    straggler_steps: int = 10
    """The window, in steps: a node is named when its fastest time in the window and the median of
    its step-by-step slowdowns both reach straggler_factor (a shared machine's noise reaches both
    only when it lasts the whole window); one step at full speed clears it."""
    straggler_rebalance: bool = True
    """The leader re-splits the microbatches among the pipelines at their measured speeds when a
    straggler is named and that shortens the estimated step by 10 % or more (the global batch,
    and so the weights, stay the same)."""
    watch_interval_s: float = 0.1
    """While a step runs, each worker checks the control plane this often: a newer plan that
    drops a lost node, this node being fenced, or the job being closed abandons the step at once
    (a hung peer is cut off by the control plane, not by a collective timing out)."""

    def validate(self) -> list[str]:
        problems = []
        if self.f < 0:
            problems.append(
                f"'fault_tolerance.f' must be >= 0 (got {self.f}): it is the number of simultaneous node failures "
                "to survive"
            )
        if self.shadow_copies < 0:
            problems.append(
                f"'fault_tolerance.shadow_copies' must be >= 0 (got {self.shadow_copies}): 0 keeps no copy "
                "in host memory"
            )
        try:
            parse_signals(self.preempt_signals)
        except ConfigError as err:
            problems.append(str(err))
        if self.preempt_grace_s <= 0:
            problems.append(f"'fault_tolerance.preempt_grace_s' must be > 0 (got {self.preempt_grace_s})")
        if (self.hang_floor_s is not None and self.hang_floor_s < 0) or self.hang_factor < 1:
            problems.append(
                "'fault_tolerance.hang_floor_s' must be >= 0 (0 = off) and 'fault_tolerance.hang_factor' >= 1 "
                f"(got {self.hang_floor_s} and {self.hang_factor})"
            )
        if self.fingerprint_interval_steps < 0:
            problems.append(
                "'fault_tolerance.fingerprint_interval_steps' must be >= 0 (0 = off; got "
                f"{self.fingerprint_interval_steps})"
            )
        if self.straggler_factor < 0 or 0 < self.straggler_factor <= 1 or self.straggler_steps < 1:
            problems.append(
                "'fault_tolerance.straggler_factor' must be 0 (off) or > 1 and "
                f"'fault_tolerance.straggler_steps' >= 1 (got {self.straggler_factor} and {self.straggler_steps})"
            )
        if self.loss_spike_factor < 0 or 0 < self.loss_spike_factor <= 1:
            problems.append(
                f"'fault_tolerance.loss_spike_factor' must be 0 (off) or > 1 (got {self.loss_spike_factor})"
            )
        if self.watch_interval_s <= 0:
            problems.append(f"'fault_tolerance.watch_interval_s' must be > 0 (got {self.watch_interval_s})")
        if self.join_timeout_s <= 0 or (self.comm_timeout_s is not None and self.comm_timeout_s <= 0):
            problems.append(
                "'fault_tolerance.join_timeout_s' and 'fault_tolerance.comm_timeout_s' must be > 0 (got "
                f"{self.join_timeout_s} and {self.comm_timeout_s})"
            )
        problems += _at_least("fault_tolerance", self, ("max_skipped_steps", "max_repeated_errors"), 1)
        if self.stall_report_s is not None and self.stall_report_s < 0:
            problems.append(f"'fault_tolerance.stall_report_s' must be >= 0 (got {self.stall_report_s})")
        return problems


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
        problems = _at_least("planning", self, ("gpus_per_node", "profile_repeats"), 1)
        problems += _at_least("planning", self, ("profile_warmup",), 0)
        if self.device_memory_gb is not None and self.device_memory_gb <= 0:
            problems.append(f"'planning.device_memory_gb' must be > 0 (got {self.device_memory_gb})")
        if self.host_memory_gb is not None and self.host_memory_gb <= 0:
            problems.append(
                f"'planning.host_memory_gb' must be > 0 (got {self.host_memory_gb}); leave it unset to measure it"
            )
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
                "oobleck_elastic.planning.profile_tp --config CFG --out profile-tp{tp}.json` and set "
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
        if self.schedule in get_args(Schedule):  # a name outside them is its own clause already
            why = schedule_chunks_problem(self.schedule, self.chunks_per_device)
            if why:
                problems.append(why)
        return problems


@dataclass
class CheckpointConfig(Section):
    dir: str = "checkpoints"
    """Directory of safetensors checkpoints. A relative path: see Paths."""
    interval_steps: int = 0
    """Save every this many steps; 0 = only at the end."""
    resume: bool = True
    """Resume from the newest checkpoint in `dir` when one exists."""

    def validate(self) -> list[str]:
        return _at_least("checkpoint", self, ("interval_steps",), 0)


@dataclass
class LoggingConfig(Section):
    tensorboard_dir: str = "runs"
    """TensorBoard log directory: one run per start of a job, `<run id>/<UTC start>` (the run id is
    the job's --rdzv-id, `name` for the single process), written by the worker holding rank 0
    (engine/telemetry/board.py). A relative path: see Paths."""
    log_interval: int = 1
    """Print a progress line every this many steps."""
    level: LogLevel = "INFO"
    """Python logging level."""
    events_dir: str = ""
    """Also write the job's events (steps, failures, generation entries, checkpoints...) as JSON
    lines, one file per worker process, in this directory (oobleck_elastic/logs.py), with the
    sample ledger that `oobleck samples --check` proves exactly-once from; empty: off. A relative
    path: see Paths."""


@dataclass
class JobConfig(Section):
    name: str = "oobleck"
    """Job name used in logs, and the TensorBoard run id of the single process."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model."""
    data: DataConfig = field(default_factory=DataConfig)
    """The training data."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """Batch sizes, steps, optimizer, precision, seed."""
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    """Failures to tolerate and detection timeouts."""
    planning: PlanningConfig = field(default_factory=PlanningConfig)
    """Device memory, devices per node, schedule, profile."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Logs and TensorBoard."""

    def validate(self) -> list[str]:
        """Every section's problems, then the rules that span sections."""
        sections: list[Section] = [
            self.model,
            self.data,
            self.training,
            self.fault_tolerance,
            self.planning,
            self.checkpoint,
            self.logging,
        ]
        problems = [problem for section in sections for problem in section.validate()]
        if self.data.seq_len > self.model.max_seq_len:
            problems.append(
                f"'data.seq_len' ({self.data.seq_len}) exceeds 'model.max_seq_len' "
                f"({self.model.max_seq_len}): lower data.seq_len or raise model.max_seq_len"
            )
        return problems


def parse_signals(names: Sequence[str]) -> list[signal.Signals]:
    """Signal names (`SIGTERM`, `USR1`, `SIGUSR1`) as signals; a ConfigError naming
    fault_tolerance.preempt_signals for an unknown name, or for SIGINT, SIGKILL or SIGSTOP."""
    out = []
    for name in names:
        full = str(name).strip().upper()
        full = full if full.startswith("SIG") else f"SIG{full}"
        sig = getattr(signal.Signals, full, None)
        if sig is None or sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGINT):
            raise ConfigError(
                f"'fault_tolerance.preempt_signals': '{name}' cannot be a preemption notice; give "
                "signal names such as SIGTERM or SIGUSR1 (not SIGINT, SIGKILL or SIGSTOP)"
            )
        out.append(sig)
    return out
