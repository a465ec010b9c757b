"""Planning plane: profile -> templates -> schedules -> plan -> tolerance, pure functions of numbers.

Rooms, each importing only those before it (tests/test_imports.py): `errors` and `comm` (links),
`profile/` (per-layer costs and their measurement: the only torch in planning, never imported
here), `templates/`, `schedules/`, `plan/` and `tolerance/`. `plan_job` (job.py) is the one call
the control plane and the CLI make; this face re-exports what they use. Imports `config`, `models`
(the profiler builds layers) and the standard library; never `etcd`, `rendezvous`, `records` or
`engine`. docs/planning.md tells the story.
"""

from __future__ import annotations

from .comm import Links
from .errors import PlanningError
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
from .plan.build import make_plan
from .plan.instantiate import Assignment, best_cover, instantiate
from .plan.plan import PipelineSpec, Plan, ShadowPlacement, StagePlacement
from .profile.microbatch import (
    MicrobatchChoice,
    MicrobatchError,
    MicrobatchOption,
    fixed_microbatch_size,
    microbatch_candidates,
    profile_at,
    profile_microbatch_sizes,
)
from .profile.profile import LayerProfile, ModelProfile, ProfileError
from .templates.templates import Template, TemplateSet, build_templates
from .tolerance.copies import Shortfall, layer_copies, shortfall
from .tolerance.guarantee import Guarantee, guarantee
from .tolerance.shadows import place_shadows, shadow_bytes, survives, tolerated_losses

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
