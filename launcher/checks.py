"""The local launcher's decisions that need no running job: the job config checked before any
node starts, how long a Ctrl-C's stop may take, whether a due `--kill` may happen, why nodes
failed, and the operations commands.

Pure functions, tested without processes. The story: docs/running.md.
"""

from __future__ import annotations

import os
import re
from typing import Callable, Mapping, Optional, Sequence

from oobleck_elastic.etcd import EtcdSettings

__all__ = [
    "cores_available",
    "etcd_view",
    "failure_reason",
    "job_name",
    "kill_verdict",
    "node_shortfall",
    "ops_commands",
    "preflight",
    "script_config",
    "stop_settings",
    "worker_threads",
]


def script_config(script: Sequence[str], rdzv_conf: str = "") -> tuple[Optional[str], list[str]]:
    """(config path, dotlist overrides) the rendezvous handler will read from the script's
    arguments (`script[0]` is the script): `--rdzv-conf config=PATH` first, else `--config PATH` /
    `--config=PATH`; overrides are the `key=value` arguments that are not options."""
    args = list(script[1:])
    config = dict(item.split("=", 1) for item in rdzv_conf.split(",") if "=" in item).get("config")
    for i, arg in enumerate(args):
        if config is None and arg == "--config" and i + 1 < len(args):
            config = args[i + 1]
        elif config is None and arg.startswith("--config="):
            config = arg.split("=", 1)[1]
    overrides = [a for a in args if "=" in a and not a.startswith("-")]
    return config, overrides


def preflight(
    script: Sequence[str], rdzv_conf: str = "", *, nodes: Optional[int] = None, warn: Callable[[str], None] = print
) -> Optional[str]:
    """The one line saying what is wrong with the job's config, its data or its resume point, or
    what it asks that `nodes` (the most this launch starts) can never give (`node_shortfall`), or
    None (nothing found, or no config to check: the handler then says what it needs). What the
    nodes cannot give but the job can train without goes to `warn`, one line each."""
    config, overrides = script_config(script, rdzv_conf)
    if config is None:
        return None
    from oobleck_elastic.config import ConfigError, load_config
    from oobleck_elastic.engine.startup import KNOWN_ERRORS, check_start, one_line

    try:
        cfg = load_config(config, overrides)
    except ConfigError as err:
        return " ".join(str(err).split("\n"))
    try:
        check_start(cfg)
    except KNOWN_ERRORS as err:
        return one_line(err)
    if nodes is None:
        return None
    refusal, warnings = node_shortfall(
        cfg.fault_tolerance.f, cfg.fault_tolerance.shadow_copies, nodes, cfg.fault_tolerance.strict
    )
    for line in warnings:
        warn(line)
    return refusal


DEFAULT_STOP_GRACE_S = 60.0
"""`fault_tolerance.preempt_grace_s`'s default: the stop's bound when the script names no config."""


def stop_settings(script: Sequence[str], rdzv_conf: str = "") -> tuple[float, Optional[str]]:
    """(seconds the job has to stop on its own after a Ctrl-C, its checkpoint directory or None):
    the job's `fault_tolerance.preempt_grace_s`, the time a node has to leave after a preemption
    notice, and `checkpoint.dir`. Defaults when the script names no config or it does not load
    (preflight said why)."""
    config, overrides = script_config(script, rdzv_conf)
    if config is None:
        return DEFAULT_STOP_GRACE_S, None
    from oobleck_elastic.config import ConfigError, load_config

    try:
        cfg = load_config(config, overrides)
    except ConfigError:
        return DEFAULT_STOP_GRACE_S, None
    return cfg.fault_tolerance.preempt_grace_s, cfg.checkpoint.dir


def node_shortfall(f: int, shadow_copies: int, nodes: int, strict: bool) -> tuple[Optional[str], list[str]]:
    """(the refusal, the warnings) for a job asking f+1 pipelines and `shadow_copies` shadow copies
    of each layer when at most `nodes` nodes will ever run it. A pipeline needs a node of its own,
    and a layer's shadow copy a node that does not hold the layer, which at least one node does:
    more copies than `nodes - 1` can never be placed (refused); fewer than f+1 pipelines train
    with a warning (one node is how a config is tried), refused under fault_tolerance.strict."""
    if shadow_copies > nodes - 1:
        return (
            f"fault_tolerance.shadow_copies={shadow_copies} needs at least {shadow_copies + 1} nodes (each copy on a "
            f"node that does not hold the layer); this launch starts at most {nodes}: lower "
            f"fault_tolerance.shadow_copies below {nodes} (`oobleck plan --nodes {nodes}` shows what fits) or start "
            "more nodes",
            [],
        )
    if f + 1 <= nodes:
        return None, []
    short = (
        f"fault_tolerance.f={f} asks for f+1={f + 1} pipelines, each on nodes of its own; this launch starts at "
        f"most {nodes} node(s)"
    )
    if strict:
        return f"fault_tolerance.strict: {short}: start more nodes or lower fault_tolerance.f", []
    return None, [f"warning: {short}: the job trains {nodes} pipeline(s), and a node's failure needs a checkpoint"]


def job_name(script: Sequence[str], rdzv_conf: str = "") -> Optional[str]:
    """The `name` of the job config the script is given (`script_config`); None when there is
    none or it does not load (`preflight` says why)."""
    config, overrides = script_config(script, rdzv_conf)
    if config is None:
        return None
    from oobleck_elastic.config import ConfigError, load_config
    from oobleck_elastic.config.job import folder_name

    try:
        name = load_config(config, overrides).name
    except ConfigError:
        return None
    return folder_name(name) or None


def kill_verdict(
    *, at: int, step: Optional[int], closed: bool, node_id: Optional[str], roster: Optional[Sequence[str]]
) -> tuple[bool, str]:
    """(whether a kill or preemption due at step `at` happens now, why not). `step`: the job's
    last reported step (None: none yet); `closed`: the job is closed; `node_id`: the target's id
    (None: not known yet); `roster`: the current plan's nodes (None: no plan yet). When the answer
    is no, the caller asks again later; the reason is what it says if the job ends first."""
    if closed:
        return False, "the job closed first"
    if step is None or step < at:
        return False, f"the job never reported step {at}" + (f" (its last was {step})" if step is not None else "")
    if node_id is None:
        return False, "the node's id is not known yet"
    if roster is None or node_id not in roster:
        return False, f"{node_id} holds no stage in the current plan (it is not training)"
    return True, ""


def plan_is_full(roster: Optional[Sequence[str]], ids: Mapping[int, str], launched: Sequence[int]) -> bool:
    """Whether the current plan (`roster`: its nodes; None: no plan yet) holds every node of
    `launched` (launcher numbers of the nodes started at launch and still running) whose ids
    `ids` are known, and all of them are known: `--faults-at-full-plan` waits for it."""
    if roster is None or any(n not in ids for n in launched):
        return False
    return all(ids[n] in roster for n in launched)


_ERROR_LINE = re.compile(r"\b(\w*Error|JobFailed)\b: |\berror: ")


def failure_reason(closed_failed: Optional[str], error_record: Optional[str], lines: Sequence[str]) -> str:
    """Why nodes failed, in one line: the reason the job was closed as failed, else the error a
    worker recorded, else the last error line in `lines` (the failed nodes' output), else ''."""
    if closed_failed:
        return closed_failed
    if error_record:
        return error_record
    for line in reversed(lines):
        text = line.strip()
        m = _ERROR_LINE.search(text)
        if m:
            return text[m.start() :] if m.group(1) else text[m.end() :]
    return ""


def ops_commands(endpoint: str, run_id: str, key_prefix: str = "/oobleck") -> list[str]:
    """The commands that inspect this job through its etcd."""
    prefix = "" if key_prefix == "/oobleck" else f" --key-prefix {key_prefix}"
    return [f"oobleck {what} --endpoint {endpoint} --run-id {run_id}{prefix}" for what in ("status", "goodput")]


def worker_threads(cores: int, workers: int, environ: Mapping[str, str]) -> tuple[Optional[int], str]:
    """The intra-op threads each worker gets (None: `OMP_NUM_THREADS` is set, and stays), and the
    line that says so."""
    given = environ.get("OMP_NUM_THREADS")
    if given:
        return None, f"each worker computes on OMP_NUM_THREADS={given} thread(s), as set ({cores} core(s))"
    threads = max(1, cores // max(1, workers))
    return threads, (
        f"each worker computes on {threads} thread(s): {cores} core(s) over up to {workers} worker(s) "
        "(set OMP_NUM_THREADS to choose)"
    )


def cores_available() -> int:
    """The cores this process may run on (its affinity mask where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def etcd_view(endpoint: str, rdzv_conf: str) -> tuple[EtcdSettings, str]:
    """The etcd settings and key prefix the nodes use, from the `--rdzv-conf` they are given (TLS,
    auth, outage bound, key_prefix), so the launcher watches the same etcd keys as they do."""
    conf = dict(item.split("=", 1) for item in rdzv_conf.split(",") if "=" in item)
    settings = EtcdSettings(
        endpoint=endpoint,
        cacert=conf.get("cacert"),
        cert=conf.get("cert"),
        key=conf.get("key"),
        user=conf.get("user"),
        password=conf.get("password"),
        outage_s=float(conf.get("etcd_outage", 60.0)),
    )
    return settings, conf.get("key_prefix", "/oobleck")
