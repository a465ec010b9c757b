"""Telemetry: what a run tells about itself.

`metrics` (TensorBoard and progress lines), `board` (the TensorBoard run: its directory, step
numbering, tags, custom-scalars page and job-level reconfiguration figures), `mfu` (FLOPs per
token, device peaks, utilisation), `goodput` (where the wall time went, per category), `runlog`
(progress, reconfigurations and the final summary of one worker's run) and `memory` (peak
resident and device memory).

Imports: `records`, `models`, `planning`, `config`, `logs`, `engine.step`, `engine.stage` and
`engine.entry`; the `Trainer` only
for type hints.
"""
