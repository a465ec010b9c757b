"""The rules of a job config that omegaconf's types cannot express (choices, ranges, combinations).

`load_config` runs `validate` on every config it builds; every broken rule becomes one clause of
one ConfigError that names the key and what to change.
"""

from __future__ import annotations

from typing import Any

from .config import ConfigError, JobConfig, parse_signals

_CHOICES: dict[str, tuple[str, ...]] = {
    "model.family": ("gpt2", "llama", "mistral", "qwen2", "custom"),
    "model.attn_implementation": ("sdpa", "eager"),
    "data.source": ("stdlib", "files", "jsonl", "parquet", "hf_disk", "tokens"),
    "data.tokenizer": ("bytes", "bpe", "hf"),
    "data.token_dtype": ("uint16", "uint32"),
    "training.optimizer.name": ("adamw", "sgd"),
    "training.lr_schedule.decay": ("constant", "linear", "cosine"),
    "training.precision": ("fp32", "bf16"),
    "training.device": ("auto", "cpu", "cuda"),
    "planning.schedule": ("1f1b", "gpipe"),
}


def validate(cfg: JobConfig, *, where: str = "<config>") -> None:
    """Check the semantic rules omegaconf's types cannot express; raise ConfigError."""
    problems: list[str] = []

    def get(key: str) -> Any:
        node: Any = cfg
        for part in key.split("."):
            node = getattr(node, part)
        return node

    for key, choices in _CHOICES.items():
        if get(key) not in choices:
            problems.append(f"'{key}' is '{get(key)}'; choose one of {', '.join(choices)}")
    try:
        parse_signals(cfg.fault_tolerance.preempt_signals)
    except ConfigError as err:
        problems.append(str(err))
    if cfg.fault_tolerance.preempt_grace_s <= 0:
        problems.append(f"'fault_tolerance.preempt_grace_s' must be > 0 (got {cfg.fault_tolerance.preempt_grace_s})")
    if cfg.fault_tolerance.hang_floor_s < 0 or cfg.fault_tolerance.hang_factor < 1:
        problems.append(
            "'fault_tolerance.hang_floor_s' must be >= 0 (0 = off) and 'fault_tolerance.hang_factor' >= 1 "
            f"(got {cfg.fault_tolerance.hang_floor_s} and {cfg.fault_tolerance.hang_factor})"
        )
    if cfg.fault_tolerance.fingerprint_interval_steps < 0:
        problems.append(
            "'fault_tolerance.fingerprint_interval_steps' must be >= 0 (0 = off; got "
            f"{cfg.fault_tolerance.fingerprint_interval_steps})"
        )
    if (
        cfg.fault_tolerance.straggler_factor < 0
        or 0 < cfg.fault_tolerance.straggler_factor <= 1
        or cfg.fault_tolerance.straggler_steps < 1
    ):
        problems.append(
            "'fault_tolerance.straggler_factor' must be 0 (off) or > 1 and "
            f"'fault_tolerance.straggler_steps' >= 1 (got {cfg.fault_tolerance.straggler_factor} "
            f"and {cfg.fault_tolerance.straggler_steps})"
        )
    if cfg.fault_tolerance.max_skipped_steps < 1:
        problems.append(
            f"'fault_tolerance.max_skipped_steps' must be >= 1 (got {cfg.fault_tolerance.max_skipped_steps})"
        )
    if cfg.fault_tolerance.loss_spike_factor < 0 or 0 < cfg.fault_tolerance.loss_spike_factor <= 1:
        problems.append(
            f"'fault_tolerance.loss_spike_factor' must be 0 (off) or > 1 (got {cfg.fault_tolerance.loss_spike_factor})"
        )
    if cfg.fault_tolerance.watch_interval_s <= 0:
        problems.append(f"'fault_tolerance.watch_interval_s' must be > 0 (got {cfg.fault_tolerance.watch_interval_s})")
    if cfg.fault_tolerance.join_timeout_s <= 0 or cfg.fault_tolerance.comm_timeout_s <= 0:
        problems.append(
            "'fault_tolerance.join_timeout_s' and 'fault_tolerance.comm_timeout_s' must be > 0 (got "
            f"{cfg.fault_tolerance.join_timeout_s} and {cfg.fault_tolerance.comm_timeout_s})"
        )
    for key in (
        "model.vocab_size",
        "model.pad_vocab_to",
        "model.hidden_size",
        "model.num_layers",
        "model.num_heads",
        "model.max_seq_len",
        "data.seq_len",
        "training.global_batch_size",
        "planning.gpus_per_node",
        "planning.profile_repeats",
        "fault_tolerance.max_repeated_errors",
    ):
        if get(key) < 1:
            problems.append(f"'{key}' must be >= 1 (got {get(key)})")
    for key in (
        "training.steps",
        "planning.profile_warmup",
        "checkpoint.interval_steps",
        "training.lr_schedule.warmup_steps",
        "fault_tolerance.stall_report_s",
    ):
        if get(key) < 0:
            problems.append(f"'{key}' must be >= 0 (got {get(key)})")
    t = cfg.training
    mbs = t.microbatch_size
    if mbs != "auto" and (isinstance(mbs, (str, bool)) or mbs < 1):
        problems.append(f"'training.microbatch_size' is {mbs!r}: give a number >= 1 or auto")
    elif isinstance(mbs, int) and t.global_batch_size % mbs:
        problems.append(
            f"'training.global_batch_size' ({t.global_batch_size}) must be a multiple of "
            f"'training.microbatch_size' ({t.microbatch_size}): change one of them, e.g. "
            f"training.global_batch_size={(t.global_batch_size // mbs + 1) * mbs}"
        )
    if cfg.fault_tolerance.f < 0:
        problems.append(
            f"'fault_tolerance.f' must be >= 0 (got {cfg.fault_tolerance.f}): "
            "it is the number of simultaneous node failures to survive"
        )
    if t.peak_tflops is not None and t.peak_tflops <= 0:
        problems.append(f"'training.peak_tflops' must be > 0 (got {t.peak_tflops}); leave it unset for the table")
    if cfg.planning.device_memory_gb is not None and cfg.planning.device_memory_gb <= 0:
        problems.append(f"'planning.device_memory_gb' must be > 0 (got {cfg.planning.device_memory_gb})")
    if not 0 <= cfg.planning.memory_margin < 1:
        problems.append(f"'planning.memory_margin' must be in [0, 1) (got {cfg.planning.memory_margin})")
    m = cfg.model
    if m.hidden_size >= 1 and m.num_heads >= 1 and m.hidden_size % m.num_heads:
        problems.append(
            f"'model.hidden_size' ({m.hidden_size}) must be a multiple of 'model.num_heads' ({m.num_heads})"
        )
    if m.num_kv_heads is not None and (m.num_kv_heads < 1 or m.num_heads % m.num_kv_heads):
        problems.append(
            f"'model.num_heads' ({m.num_heads}) must be a multiple of 'model.num_kv_heads' ({m.num_kv_heads})"
        )
    if cfg.data.seq_len > m.max_seq_len:
        problems.append(
            f"'data.seq_len' ({cfg.data.seq_len}) exceeds 'model.max_seq_len' "
            f"({m.max_seq_len}): lower data.seq_len or raise model.max_seq_len"
        )
    if cfg.model.family == "custom" and not cfg.model.custom_factory:
        problems.append(
            "'model.family' is custom but 'model.custom_factory' is not set "
            "(give module:function returning a list[nn.Module])"
        )
    d = cfg.data
    if d.source in ("files", "jsonl", "parquet", "hf_disk", "tokens") and not d.paths:
        problems.append(f"'data.source' is {d.source} but 'data.paths' is empty")
    if d.source == "hf_disk" and len(d.paths) > 1:
        problems.append(
            f"'data.source' is hf_disk but 'data.paths' has {len(d.paths)} entries: give the one "
            "directory written by Dataset.save_to_disk"
        )
    if d.tokenizer == "hf" and d.source != "tokens" and not d.tokenizer_path:
        problems.append(
            "'data.tokenizer' is hf but 'data.tokenizer_path' is not set: give the directory of a "
            "tokenizer saved with save_pretrained"
        )
    if d.tokenizer_path and d.tokenizer != "hf":
        problems.append(
            f"'data.tokenizer_path' is set but 'data.tokenizer' is {d.tokenizer}: set data.tokenizer=hf to use it"
        )
    if d.num_proc < 1:
        problems.append(f"'data.num_proc' must be >= 1 (got {d.num_proc})")
    p = cfg.planning
    tp = p.tensor_parallel
    if tp != "auto" and (isinstance(tp, str) or tp < 1 or (p.gpus_per_node >= 1 and p.gpus_per_node % tp)):
        problems.append(
            f"'planning.tensor_parallel' is {tp!r}: give a divisor of planning.gpus_per_node "
            f"({p.gpus_per_node}) or auto"
        )
    if tp != 1 and not p.profile_path:
        problems.append(
            f"'planning.tensor_parallel' is {tp} but 'planning.profile_path' is not set: workers measure "
            "profiles on one device; measure one at each degree with `torchrun --nproc-per-node T -m "
            "oobleck_elastic.planning.profile_tp --config CFG --out profile-tp{tp}.json` and set "
            "planning.profile_path=profile-tp{tp}.json"
        )
    if p.intra_node_bandwidth_gb_s <= 0 or p.inter_node_bandwidth_gb_s <= 0 or p.link_latency_us < 0:
        problems.append(
            "'planning.intra_node_bandwidth_gb_s' and 'planning.inter_node_bandwidth_gb_s' must be > 0 "
            "and 'planning.link_latency_us' >= 0 (got "
            f"{p.intra_node_bandwidth_gb_s}, {p.inter_node_bandwidth_gb_s}, {p.link_latency_us})"
        )
    if cfg.planning.max_nodes is not None and cfg.planning.max_nodes < 1:
        problems.append(f"'planning.max_nodes' must be >= 1 (got {cfg.planning.max_nodes})")
    if problems:
        raise ConfigError(f"{where}: " + "; ".join(problems))
