"""The benchmarks: `python -m bench` lists them, `python -m bench NAME [--quick] [ARGS...]` runs one
(from the repository root). Each is a module here declaring `BENCH` (harness.Bench); every result
is one JSON line carrying the commit, the machine's load, its CPU count and the torch version.
Results, each with its command and commit, are in bench/RESULTS.md."""

from __future__ import annotations

# every bench, by module name (harness.py, baseline_train.py, the torchrun worker of the recovery
# baseline, and gpu_engine.py, the checks gpu_checks runs, are not benches)
BENCHES = (
    "control_plane",
    "fingerprint",
    "gpu_checks",
    "gpu_mfu",
    "gpu_step",
    "keepalive",
    "losses",
    "memory",
    "mixed",
    "multigpu",
    "overhead",
    "planner",
    "recovery",
    "schedules",
    "shadows",
    "simulate",
    "straggler",
    "stress",
)
