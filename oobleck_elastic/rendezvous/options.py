"""What the `oobleck` backend learns of its launch: its `--rdzv-conf` options, the job config,
the devices per node, and which of its two modes runs the job.

torchrun builds a handler from `RendezvousParameters` alone; this module reads everything else
from there, quietly. The story: docs/running.md.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Any, Mapping, NoReturn, Optional

from torch.distributed.elastic.rendezvous import RendezvousParameters

from ..etcd import EtcdSettings

if TYPE_CHECKING:
    from ..config import JobConfig

RDZV_OPTIONS = {
    "mode": "in_place (workers use the worker context), restart (torchrun's semantics for plain scripts) or auto "
    "(default: in_place when a job config is found, else restart)",
    "config": "job YAML (default: the training script's --config argument on torchrun's command line)",
    "nproc_per_node": "devices per node (default: torchrun's --nproc-per-node)",
    "lease_ttl": "seconds before a silent node's record expires (default fault_tolerance.lease_ttl_s)",
    "last_call_timeout": "seconds to wait for more nodes once --nnodes MIN are up (default 2)",
    "settle": "seconds that batch simultaneous membership changes (default fault_tolerance.settle_s)",
    "cacert": "CA certificate of the etcd server (enables TLS)",
    "cert": "client certificate for mutual TLS",
    "key": "client key for mutual TLS",
    "user": "etcd user",
    "password": "etcd password",
    "key_prefix": "etcd key prefix (default /oobleck)",
    "join_timeout": "seconds a node waits to be admitted before giving up (default 600)",
    "etcd_outage": "seconds etcd requests are retried while etcd is unreachable before failing (default 60)",
    "device_class": "this node's device class, one of the job config's planning.classes (default: the "
    "OOBLECK_DEVICE_CLASS environment variable, else none: every node alike)",
}
# set by torchrun itself, or options of torch's dynamic rendezvous (mode=restart); accepted silently
TORCHRUN_OPTIONS = {
    "timeout",
    "close_timeout",
    "heartbeat",
    "is_host",
    "local_addr",
    "read_timeout",
    "keep_alive_interval",
    "keep_alive_max_attempt",
}
MODES = ("auto", "in_place", "restart")


def rdzv_conf(params: RendezvousParameters) -> dict[str, Any]:
    """The `--rdzv-conf` entries that are set; unknown ones are refused with the known ones named."""
    conf = {k: v for k, v in params.config.items() if v is not None}
    unknown = set(conf) - set(RDZV_OPTIONS) - TORCHRUN_OPTIONS
    if unknown:
        raise ValueError(
            f"unknown --rdzv-conf option(s) {sorted(unknown)} for --rdzv-backend=oobleck; "
            f"known: {', '.join(sorted(RDZV_OPTIONS))}"
        )
    mode = str(conf.get("mode", "auto"))
    if mode not in MODES:
        raise ValueError(f"--rdzv-conf mode={mode}: give one of {', '.join(MODES)}; mode: {RDZV_OPTIONS['mode']}")
    return conf


def seconds(conf: Mapping[str, Any], option: str, default: float, *, zero_ok: bool = False) -> float:
    """`--rdzv-conf option=S` as seconds (> 0, or >= 0 with `zero_ok`), else `default`."""
    value = conf.get(option, default)
    try:
        result = float(value)
    except (TypeError, ValueError):
        result = float("nan")
    if not (result >= 0 if zero_ok else result > 0):
        raise ValueError(
            f"--rdzv-conf {option}={value}: give a number of seconds {'>=' if zero_ok else '>'} 0 "
            f"(e.g. {option}={default:g}); {option}: {RDZV_OPTIONS[option]}"
        )
    return result


def device_class_of(conf: Mapping[str, Any], cfg: "JobConfig") -> str:
    """This node's device class: `--rdzv-conf device_class=NAME`, else OOBLECK_DEVICE_CLASS, else
    "" (none). A class the job config does not define, or none in a job that defines classes, is
    refused in one line naming the node's setting and the config's key."""
    given = conf.get("device_class") or os.environ.get("OOBLECK_DEVICE_CLASS", "")
    where = "--rdzv-conf device_class" if conf.get("device_class") else "OOBLECK_DEVICE_CLASS"
    known = cfg.planning.classes
    if given and given not in known:
        have = ", ".join(sorted(known)) or "none"
        raise ValueError(
            f"{where}={given}: the job config's planning.classes defines {have}; add planning.classes.{given}, "
            "or give one of them"
        )
    if not given and known:
        raise ValueError(
            f"the job config defines device classes ({', '.join(sorted(known))}) but this node declares none: "
            "give --rdzv-conf device_class=NAME (or OOBLECK_DEVICE_CLASS=NAME)"
        )
    return str(given)


def class_devices_problem(cfg: "JobConfig", device_class: str, nproc: int) -> Optional[str]:
    """Why a node of `nproc` devices cannot be of class `device_class` (its declared devices per
    node differ), or None."""
    own = cfg.planning.classes.get(device_class) if device_class else None
    if own is None or own.gpus_per_node is None or own.gpus_per_node == nproc:
        return None
    return (
        f"this node has {nproc} device(s) (--nproc-per-node) but its class {device_class} declares "
        f"planning.classes.{device_class}.gpus_per_node={own.gpus_per_node}: make them agree"
    )


def etcd_settings(params: RendezvousParameters, conf: Mapping[str, Any]) -> EtcdSettings:
    return EtcdSettings(
        endpoint=params.endpoint or "127.0.0.1:2379",
        cacert=conf.get("cacert"),
        cert=conf.get("cert"),
        key=conf.get("key"),
        user=conf.get("user"),
        password=conf.get("password"),
        outage_s=seconds(conf, "etcd_outage", 60.0),
    )


@dataclass(frozen=True)
class Launch:
    """What the handler knows of its launch (docs/running.md)."""

    config: Optional[str] = None
    """The job YAML, or None (none given)."""
    overrides: list[str] = field(default_factory=list)
    """The training script's `key=value` overrides of the config."""
    nproc: Optional[int] = None
    """Devices per node, when known before the agent asks for a rendezvous."""
    mode: str = "auto"


def script_config(script_args: list[str]) -> tuple[Optional[str], list[str]]:
    """(--config value, `key=value` overrides) of a training script's arguments."""
    config = None
    for i, arg in enumerate(script_args):
        if arg == "--config" and i + 1 < len(script_args):
            config = script_args[i + 1]
        elif arg.startswith("--config="):
            config = arg.split("=", 1)[1]
    return config, [a for a in script_args if "=" in a and not a.startswith("-")]


def parse_torchrun(argv: list[str]) -> Optional[Any]:
    """torchrun's arguments parsed from `argv` (argv[0] is the program), or None, printing nothing."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()

    def fail(message: str) -> NoReturn:
        raise ValueError(message)

    parser.error = fail  # type: ignore[method-assign]
    try:
        return parser.parse_args(argv[1:])
    except (ValueError, SystemExit):
        return None


def _nproc(value: Any) -> Optional[int]:
    text = str(value)
    return int(text) if text.isdigit() and int(text) > 0 else None


def launch_of(params: RendezvousParameters, argv: Optional[list[str]] = None) -> Launch:
    """The launch of this handler: `argv` is a torchrun command line given by the caller (tests);
    without it, `sys.argv` counts only when it is this rendezvous's torchrun command (docs/running.md)."""
    conf = rdzv_conf(params)
    args = parse_torchrun(argv if argv is not None else sys.argv)
    if (
        argv is None
        and args is not None
        and not (
            args.rdzv_backend == params.backend
            and args.rdzv_id == params.run_id
            and args.rdzv_endpoint == params.endpoint
        )
    ):
        args = None  # another program's arguments, or another rendezvous
    config, overrides = script_config(list(args.training_script_args)) if args is not None else (None, [])
    nproc = _nproc(conf["nproc_per_node"]) if "nproc_per_node" in conf else None
    if "nproc_per_node" in conf and nproc is None:
        raise ValueError(f"--rdzv-conf nproc_per_node={conf['nproc_per_node']}: give a number of devices > 0")
    if nproc is None and args is not None:
        nproc = _nproc(args.nproc_per_node)
    if conf.get("config"):
        config = str(conf["config"])
    return Launch(config=config, overrides=overrides, nproc=nproc, mode=str(conf.get("mode", "auto")))


def mode_of(launch: Launch) -> str:
    """`in_place` or `restart` (docs/running.md)."""
    if launch.mode != "auto":
        return launch.mode
    return "in_place" if launch.config else "restart"


def agent_local_world_size(handler: object, frame: Optional[FrameType] = None, depth: int = 8) -> Optional[int]:
    """`local_world_size` of the torch agent's `WorkerSpec` whose `rdzv_handler` is `handler`, from the
    frames that called `next_rendezvous()` (the agent's `_rendezvous(worker_group)`); None when no
    agent is calling (tests, other callers)."""
    frame = frame if frame is not None else sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        for name in ("spec", "worker_group"):
            obj = frame.f_locals.get(name)
            spec = getattr(obj, "spec", obj)
            if spec is not None and getattr(spec, "rdzv_handler", None) is handler:
                return _nproc(getattr(spec, "local_world_size", None))
        frame = frame.f_back
    return None


__all__ = [
    "Launch",
    "MODES",
    "RDZV_OPTIONS",
    "TORCHRUN_OPTIONS",
    "agent_local_world_size",
    "etcd_settings",
    "launch_of",
    "mode_of",
    "rdzv_conf",
    "device_class_of",
    "class_devices_problem",
    "script_config",
    "seconds",
]
