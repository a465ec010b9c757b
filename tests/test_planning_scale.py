"""Planning at scale: the fast paths give the very results of the direct computations they replace."""

from __future__ import annotations

from oobleck_elastic.planning import Links, build_templates
from oobleck_elastic.planning.analytic import gpt3_175b_profile
from oobleck_elastic.planning.instantiate import candidate_makespans


def test_candidate_makespans_are_the_iteration_times_bit_for_bit() -> None:
    ts = build_templates(
        gpt3_175b_profile(tensor_parallel=8),
        gpus_per_node=8,
        device_memory_gb=80.0,
        memory_margin=0.1,
        links=Links(),
        tensor_parallel=8,
        max_nodes=20,
    )
    tpl = [ts[n] for n in ts.sizes()]
    want = sorted({t.iteration_time(b, 3) for t in tpl for b in range(1, 41)})
    assert candidate_makespans(tpl, 3, 40).tolist() == want
