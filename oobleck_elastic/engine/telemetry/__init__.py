"""Telemetry: what a run tells about itself.

`metrics` (TensorBoard and progress lines), `board` (the TensorBoard run: directory, steps,
tags, custom-scalars page, reconfiguration figures), `mfu` (FLOPs per token, device peaks,
utilisation), `goodput` (where the wall time went), `runlog` (progress, reconfigurations and
the summary of one worker's run), `samples` (the sample ledger) and `memory` (peak memory).

Imports: `records`, `models`, `planning`, `config`, `logs`, `engine.step`, `engine.stage` and
`engine.entry`; the `Trainer` only for type hints.
"""
