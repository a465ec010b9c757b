"""Planning plane: profile -> templates -> plan. Pure functions of numbers (no torch.distributed,
no etcd, no engine), so they can be tested exhaustively and benchmarked at scale.

`plan_job` (job.py) is the one call the control plane and the CLI make; below it, `profile` (the
per-layer costs), `profiler` (measuring them, one layer at a time), `layer_meter` (one layer's
measurement), `profile_cache` (which profile a job uses: a file, the cache or a new measurement),
`partition` and `templates` (the best stage partition for every node count), `instantiate` (how
many pipelines of each template, and their microbatches), `placement` (which nodes, keeping layers
where they are), `plan` (the plan and its JSON), `copies` (the copies of each layer against f+1),
`microbatch` (the microbatch size), `comm` (links), `analytic` (a profile from a formula, for large
models), `rebalance` (re-splitting the batch around a straggler), and `schedules`, `schedule_sim`,
`schedule_cost` (pipeline schedules as per-device action lists, and their step time and memory from
one simulation; the planner does not choose among them yet).

Imports: `config`, `models` (the profiler builds layers to measure them) and the standard library;
never `etcd`, `rendezvous`, `records` or `engine`.

`shadows` places each layer's host-memory shadow copies on a plan (on nodes that do not hold it on
their devices) and says which node losses the plan then survives.
"""

from __future__ import annotations

from .comm import Links
from .tolerance.copies import Shortfall, layer_copies, shortfall
from .plan.instantiate import Assignment, best_cover, instantiate
from .job import (
    JobPlan,
    choose_microbatch_size,
    choose_tensor_parallel,
    compare_tensor_parallel,
    device_memory,
    host_memory,
    links_for,
    load_profiles,
    plan_job,
    single_worker_microbatch_size,
    templates_for,
    tensor_parallel_degrees,
    with_shadows,
)
from .profile.microbatch import (
    MicrobatchChoice,
    MicrobatchError,
    MicrobatchOption,
    fixed_microbatch_size,
    microbatch_candidates,
    profile_at,
    profile_microbatch_sizes,
)
from .tolerance.guarantee import Guarantee, guarantee
from .plan.plan import PipelineSpec, Plan, StagePlacement
from .plan.build import make_plan
from .profile.profile import LayerProfile, ModelProfile, ProfileError
from .plan.plan import ShadowPlacement
from .tolerance.shadows import place_shadows, shadow_bytes, survives, tolerated_losses
from .errors import PlanningError
from .templates.templates import Template, TemplateSet, build_templates

__all__ = [
    "Assignment",
    "Guarantee",
    "Shortfall",
    "JobPlan",
    "LayerProfile",
    "ModelProfile",
    "PipelineSpec",
    "Plan",
    "PlanningError",
    "ProfileError",
    "StagePlacement",
    "Template",
    "TemplateSet",
    "best_cover",
    "build_templates",
    "device_memory",
    "guarantee",
    "layer_copies",
    "shortfall",
    "instantiate",
    "make_plan",
    "plan_job",
    "templates_for",
    "Links",
    "links_for",
    "load_profiles",
    "choose_tensor_parallel",
    "compare_tensor_parallel",
    "tensor_parallel_degrees",
    "MicrobatchChoice",
    "MicrobatchError",
    "MicrobatchOption",
    "choose_microbatch_size",
    "fixed_microbatch_size",
    "microbatch_candidates",
    "profile_at",
    "profile_microbatch_sizes",
    "single_worker_microbatch_size",
    "ShadowPlacement",
    "host_memory",
    "place_shadows",
    "shadow_bytes",
    "survives",
    "tolerated_losses",
    "with_shadows",
]
