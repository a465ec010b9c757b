"""bench/schedules.py with compiled layers (`training.compile=true`): the same paced 4-stage
pipeline (m = p = 4), schedules alternated, one JSON line per run and a summary per schedule.

Compiled layers run zero-bubble's split backward through separate input- and weight-gradient
graphs (engine/stage/split_layer.py); this measures compiled zero-bubble against compiled 1F1B on
paced devices, where each pass is padded to the plan's time, so the schedule's bubble shows and
the compiled arithmetic (a few ms on these tiny layers) is a small share of each pass. A pass that
overran its target shows in `overruns`. The workers share one inductor cache (the run's
`data.cache_dir`), so only the first job compiles cold.

Run (about 1-2 min per job on 2 cores):

    .venv/bin/python bench/compile_schedules.py [--schedules 1f1b zero-bubble] [--repeats 2] [--steps 20]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import schedules  # noqa: E402

if __name__ == "__main__":
    schedules.OVERRIDES.append("training.compile=true")  # read by its jobs and its estimates
    if "--schedules" not in sys.argv:
        sys.argv[1:1] = ["--schedules", "1f1b", "zero-bubble"]
    schedules.main()
