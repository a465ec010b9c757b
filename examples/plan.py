"""Plan a job from Python: profile (or read a profile), build templates, instantiate on N nodes.
The story: docs/planning.md.

    python examples/plan.py --config configs/gpt2-tiny.yaml --nodes 4
"""

import argparse

from oobleck_elastic.config import load_config
from oobleck_elastic.planning import ModelProfile, plan_job
from oobleck_elastic.planning.profile.cache import load_or_profile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    cfg = load_config(args.config, args.overrides)
    profile = ModelProfile.load(cfg.planning.profile_path) if cfg.planning.profile_path else load_or_profile(cfg)
    job = plan_job(cfg, nodes=args.nodes, profile=profile)
    print(job.guarantee.describe())
    for pipe in job.plan.pipelines:
        ranges = [(s.start, s.end) for s in pipe.stages]
        print(f"pipeline {pipe.index}: nodes {list(pipe.nodes)}, {pipe.microbatches} microbatches, layers {ranges}")


if __name__ == "__main__":
    main()
